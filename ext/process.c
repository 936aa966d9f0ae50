/*
 * amesh._native._ext's process helpers, for a worker and its zygote, without ctypes (which
 * costs a freshly forked process page copies and time): exit_when_closed(), a
 * worker's watch of the pipe its parent holds, as a bare thread that ends the process
 * when the pipe closes; set_parent_death_signal(), the kernel's half of that watch;
 * line_buffer_stdout() and flush_stdio(), C's stdio for a worker whose fds 1 and 2
 * are pipes to its output capture; immortalize(), the zygote's objects made immortal
 * before it forks.
 */

#include "amesh_ext.h"

/* ========================================================================== */
/* exit_when_closed(): a worker dies with the pipe its parent holds             */
/* ========================================================================== */

/*
 * exit_when_closed(fd): a detached thread of its own (a small stack, every signal
 * blocked, never the GIL) reads fd until end of file or an error, and then ends the
 * process at once (_exit(1)). A worker watches the pipe whose write end only its
 * parent holds, so that it dies with the parent. What starting a Python thread for
 * this costs a freshly forked worker (its thread state, the GIL handed back and forth)
 * is most of a millisecond; this thread costs a clone.
 */
static void *
exit_watch_main(void *arg)
{
    int fd = (int)(intptr_t)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    char buf[512];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n > 0 || (n < 0 && errno == EINTR)) {
            continue;
        }
        _exit(1);
    }
    return NULL;
}

static PyObject *
ext_exit_when_closed(PyObject *module, PyObject *arg)
{
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (fd < 0 || fd > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "not a file descriptor: %ld", fd);
        return NULL;
    }
    pthread_attr_t attr;
    int rc = pthread_attr_init(&attr);
    if (rc == 0) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        pthread_t thread;
        rc = pthread_create(&thread, &attr, exit_watch_main, (void *)(intptr_t)fd);
        pthread_attr_destroy(&attr);
    }
    if (rc != 0) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/*
 * set_parent_death_signal(sig): prctl(PR_SET_PDEATHSIG, sig) on Linux (0: none).
 * Through ctypes, this one system call cost a freshly forked process 0.2-0.4 ms and
 * 75-90 page copies (a CDLL, a symbol looked up, libffi warmed up); a worker, ~40.
 */
static PyObject *
ext_set_parent_death_signal(PyObject *module, PyObject *arg)
{
    long sig = PyLong_AsLong(arg);
    if (sig == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (sig < 0 || sig >= NSIG) {
        PyErr_Format(PyExc_ValueError, "not a signal number: %ld", sig);
        return NULL;
    }
#ifdef __linux__
    if (prctl(PR_SET_PDEATHSIG, (unsigned long)sig, 0UL, 0UL, 0UL) != 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_OSError, "a parent-death signal needs Linux");
    return NULL;
#endif
}

/*
 * line_buffer_stdout(): C's stdout line-buffered (on a pipe glibc would hold lines
 * back), in a buffer of its own: with none given, glibc keeps the one byte that an
 * unbuffered stream (PYTHONUNBUFFERED, which workers get) has, and writes a line in
 * pieces. flush_stdio(): fflush(NULL), the GIL released (a full pipe waits for the
 * thread that reads it, which needs the GIL). ctypes costs a fresh worker ~40 page
 * copies and ~0.2 ms for the first.
 */
static char stdout_line[BUFSIZ];

static PyObject *
ext_line_buffer_stdout(PyObject *module, PyObject *unused)
{
    if (setvbuf(stdout, stdout_line, _IOLBF, sizeof stdout_line) != 0) {
        PyErr_SetString(PyExc_OSError, "setvbuf failed on C's stdout");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
ext_flush_stdio(PyObject *module, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    fflush(NULL);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/*
 * immortalize(objects) -> count: on CPython 3.12 and 3.13 with the GIL, make each
 * object of the list immortal (PEP 683: its reference count is never written again),
 * and with it what each refers to that the collector does not track (strings and
 * numbers, code objects with their constants and names, tuples and dicts it has
 * untracked), and give each type of the list a version tag (its attribute cache key);
 * the count is how many were not immortal before. A zygote runs it over
 * gc.get_objects() once, before it forks: a child then uses the zygote's functions,
 * types and constants without copying the pages their reference counts are on. The
 * list itself is left alone. Elsewhere (3.11, a free-threaded build) it does nothing
 * and returns 0. Objects made immortal are never freed: only for a heap that lives
 * as long as the process.
 */
#if PY_VERSION_HEX >= 0x030C0000 && PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
#define AMESH_CAN_IMMORTALIZE 1
#else
#define AMESH_CAN_IMMORTALIZE 0
#endif

#if AMESH_CAN_IMMORTALIZE
/* Nesting of untracked containers and code objects followed (a guard: they hold no
 * cycles, and real nesting is a few levels). */
#define IMMORTAL_DEPTH 64

typedef struct {
    Py_ssize_t count;
    int depth;
} ImmortalWalk;

static int immortal_visit(PyObject *op, void *arg);

static void
immortal_set(PyObject *op, ImmortalWalk *walk)
{
    op->ob_refcnt = _Py_IMMORTAL_REFCNT;
    walk->count++;
}

/* What an untracked object refers to: a code object's fields, an untracked
 * container's items. */
static void
immortal_inside(PyObject *op, ImmortalWalk *walk)
{
    if (walk->depth >= IMMORTAL_DEPTH) {
        return;
    }
    walk->depth++;
    if (PyCode_Check(op)) {
        PyCodeObject *code = (PyCodeObject *)op;
        immortal_visit(code->co_consts, walk);
        immortal_visit(code->co_names, walk);
        immortal_visit(code->co_localsplusnames, walk);
        immortal_visit(code->co_localspluskinds, walk);
        immortal_visit(code->co_filename, walk);
        immortal_visit(code->co_name, walk);
        immortal_visit(code->co_qualname, walk);
        immortal_visit(code->co_linetable, walk);
        immortal_visit(code->co_exceptiontable, walk);
    }
    else if (PyObject_IS_GC(op) && Py_TYPE(op)->tp_traverse != NULL) {
        /* (PyObject_IS_GC asks the type: a static type is no GC object) */
        Py_TYPE(op)->tp_traverse(op, immortal_visit, walk);
    }
    walk->depth--;
}

/* A referent: tracked ones are in the list (their turn comes); the others are
 * followed here, once (an immortal one was seen, or needs nothing). */
static int
immortal_visit(PyObject *op, void *arg)
{
    ImmortalWalk *walk = (ImmortalWalk *)arg;
    if (op == NULL || _Py_IsImmortal(op)) {
        return 0;
    }
    immortal_set(op, walk);
    if (!PyObject_GC_IsTracked(op)) {
        immortal_inside(op, walk);
    }
    return 0;
}
#endif

static PyObject *
ext_immortalize(PyObject *module, PyObject *objects)
{
    if (!PyList_Check(objects)) {
        PyErr_Format(PyExc_TypeError, "immortalize() takes a list, not %.100s",
                     Py_TYPE(objects)->tp_name);
        return NULL;
    }
#if AMESH_CAN_IMMORTALIZE
    ImmortalWalk walk = {0, 0};
    /* (the list may not change under us: no Python code runs in the walk) */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objects); i++) {
        PyObject *op = PyList_GET_ITEM(objects, i);
        if (op == objects) {
            continue;
        }
        if (!_Py_IsImmortal(op)) {
            immortal_set(op, &walk);
        }
        if (PyType_Check(op)) {
            /* a child's first look-up of an attribute would write one: -20 pages */
            PyUnstable_Type_AssignVersionTag((PyTypeObject *)op);
        }
        if (PyObject_GC_IsTracked(op)) {
            Py_TYPE(op)->tp_traverse(op, immortal_visit, &walk);
        }
        else {
            immortal_inside(op, &walk);
        }
    }
    return PyLong_FromSsize_t(walk.count);
#else
    return PyLong_FromLong(0);
#endif
}

static PyMethodDef process_functions[] = {
    {"exit_when_closed", (PyCFunction)ext_exit_when_closed, METH_O,
     "exit_when_closed(fd): a thread of its own ends the process (_exit(1)) once\n"
     "fd reads end of file or fails."},
    {"set_parent_death_signal", (PyCFunction)ext_set_parent_death_signal, METH_O,
     "set_parent_death_signal(sig): the kernel sends this process sig when the thread\n"
     "that forked it ends (prctl PR_SET_PDEATHSIG; Linux only; 0: no signal)."},
    {"line_buffer_stdout", (PyCFunction)ext_line_buffer_stdout, METH_NOARGS,
     "line_buffer_stdout(): make C's stdout line-buffered."},
    {"flush_stdio", (PyCFunction)ext_flush_stdio, METH_NOARGS,
     "flush_stdio(): fflush every C stdio stream, the GIL released."},
    {"immortalize", (PyCFunction)ext_immortalize, METH_O,
     "immortalize(objects) -> count: make the listed objects, and what they refer to\n"
     "that the collector does not track, immortal (CPython 3.12 and 3.13; else 0)."},
    {NULL, NULL, 0, NULL},
};

int
amesh_exec_process(PyObject *module, ext_state *st)
{
    if (PyModule_AddObjectRef(module, "CAN_IMMORTALIZE",
                              AMESH_CAN_IMMORTALIZE ? Py_True : Py_False) < 0) {
        return -1;
    }
    return PyModule_AddFunctions(module, process_functions);
}
