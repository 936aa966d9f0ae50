/*
 * amesh._native._ext's heartbeat thread. Beat: a thread of its own that writes a worker's
 * heartbeat every period to a connected stream socket (or an NNG socket) and never
 * takes the GIL, so that a main thread holding the GIL for long (one long C call) is
 * not declared dead. It withholds the beats once the main thread has been in
 * uninterruptible sleep (state D, read from /proc) for longer than it is told.
 */

#include "amesh_ext.h"

/* ========================================================================== */
/* Beat: heartbeats written by a C thread that never takes the GIL             */
/* ========================================================================== */

/* The thread only makes system calls (send, pread, clock and condition waits) or,
 * for an NNG socket, the bound NNG functions, which take no Python lock. So a
 * main thread that holds the GIL for a long time (one long C call, a large
 * allocation) does not silence it, and a stopped or frozen process does.
 *
 * Python connects (and authenticates) the socket and hands it over; the thread
 * writes the same bytes every period. A partly written frame is finished before
 * the next one starts, so the stream is never garbled; a beat that finds the
 * socket full is dropped. A send that fails otherwise ends the thread and is
 * recorded (``broken``): Python connects again and makes a new Beat. */

enum { BEAT_SENT, BEAT_DROPPED, BEAT_WITHHELD, BEAT_BROKEN };

typedef struct Beat {
    PyObject_HEAD
    ext_state *st; /* the module outlives us: our type holds a reference to it */
    struct Beat **pprev, *next; /* in st->beats while an NNG beat's thread may run (GIL) */
    /* Set before the thread starts; the thread only reads them. */
    int fd;             /* a connected stream socket, owned; or -1 */
    nng_socket nsock;   /* or an NNG socket (id 0: none) */
    char *frame;
    size_t frame_len;
    int64_t period_ns;
    int64_t hung_ns;    /* withhold beats once the watched thread is in D this long */
    int stat_fd;        /* /proc/self/task/<tid>/stat of the watched thread, or -1 */
    pid_t owner;        /* the process whose thread this is (not a forked child) */
    pthread_t thread;
    int running;        /* the thread was started and nobody joins it yet (GIL) */
    int sync_ready;     /* mu and cv are initialized */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* Guarded by mu. */
    int stop;           /* close() asks the thread to end */
    int joined;         /* the thread has ended and was joined (or never started) */
    unsigned long long sent, dropped, withheld;
    int error;          /* 0, or the errno (NNG error) of the send that broke */
    int hung;           /* the last beat was withheld: the watched thread is hung */
    /* The thread's own. */
    size_t rest;        /* bytes of the last frame not written yet */
    int64_t d_since;    /* first of an unbroken run of looks that saw state D; -1 */
} Beat;

static int64_t
monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Whether the watched thread has been in uninterruptible sleep (state D) in every
 * look for longer than hung_ns. A thread that cannot be read is not hung. */
static int
beat_watched_hung(Beat *b, int64_t now)
{
    if (b->stat_fd < 0) {
        return 0;
    }
    char buf[512];
    ssize_t n = pread(b->stat_fd, buf, sizeof(buf) - 1, 0);
    int in_d = 0;
    if (n > 0) {
        buf[n] = '\0';
        /* "tid (comm) S ...": comm may hold anything, so take the last ')'. */
        const char *end = strrchr(buf, ')');
        in_d = end != NULL && end[1] == ' ' && end[2] == 'D';
    }
    if (!in_d) {
        b->d_since = -1;
        return 0;
    }
    if (b->d_since < 0) {
        b->d_since = now;
    }
    return now - b->d_since > b->hung_ns;
}

static int
beat_send_failed(int err, int *error)
{
    if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ENOBUFS ||
        err == ENOMEM) {
        return BEAT_DROPPED;
    }
    *error = err;
    return BEAT_BROKEN;
}

static int
beat_stream(Beat *b, int *error)
{
    const int flags = MSG_DONTWAIT | MSG_NOSIGNAL;
    ssize_t n;
    if (b->rest > 0) { /* finish the last frame first, or the stream is garbage */
        n = send(b->fd, b->frame + (b->frame_len - b->rest), b->rest, flags);
        if (n < 0) {
            return beat_send_failed(errno, error);
        }
        b->rest -= (size_t)n;
        if (b->rest > 0) {
            return BEAT_DROPPED;
        }
    }
    n = send(b->fd, b->frame, b->frame_len, flags);
    if (n < 0) {
        return beat_send_failed(errno, error);
    }
    b->rest = b->frame_len - (size_t)n;
    return BEAT_SENT;
}

static int
beat_nng(Beat *b, int *error)
{
    const nng_api *api = &b->st->api;
    nng_msg *msg = NULL;
    if (api->msg_alloc(&msg, b->frame_len) != 0) {
        return BEAT_DROPPED;
    }
    memcpy(api->msg_body(msg), b->frame, b->frame_len);
    int rv = api->sendmsg(b->nsock, msg, NNG_FLAG_NONBLOCK);
    if (rv == 0) {
        return BEAT_SENT;
    }
    api->msg_free(msg); /* NNG takes ownership only on success */
    if (rv == NNG_EAGAIN) {
        return BEAT_DROPPED;
    }
    *error = rv;
    return BEAT_BROKEN;
}

/* The thread: no Python here, not even the GIL. */
static void *
beat_main(void *arg)
{
    Beat *b = (Beat *)arg;
    int64_t next = monotonic_ns();

    pthread_mutex_lock(&b->mu);
    while (!b->stop) {
        pthread_mutex_unlock(&b->mu);
        int error = 0, outcome;
        if (beat_watched_hung(b, monotonic_ns())) {
            outcome = BEAT_WITHHELD;
        }
        else if (b->fd >= 0) {
            outcome = beat_stream(b, &error);
        }
        else {
            outcome = beat_nng(b, &error);
        }
        pthread_mutex_lock(&b->mu);
        b->hung = outcome == BEAT_WITHHELD;
        if (outcome == BEAT_SENT) {
            b->sent++;
        }
        else if (outcome == BEAT_DROPPED) {
            b->dropped++;
        }
        else if (outcome == BEAT_WITHHELD) {
            b->withheld++;
        }
        else {
            b->error = error;
            break;
        }
        int64_t now = monotonic_ns();
        next += b->period_ns;
        if (next <= now) { /* late (the machine was busy): keep the period from now */
            next = now + b->period_ns;
        }
        int64_t at = next;
#if defined(__APPLE__) /* no monotonic condition variables: wait by the wall clock */
        struct timespec wall;
        clock_gettime(CLOCK_REALTIME, &wall);
        at += (int64_t)wall.tv_sec * 1000000000 + wall.tv_nsec - monotonic_ns();
#endif
        struct timespec deadline = {(time_t)(at / 1000000000), (long)(at % 1000000000)};
        while (!b->stop) {
            int rc = pthread_cond_timedwait(&b->cv, &b->mu, &deadline);
            if (rc != 0 && rc != EINTR) {
                break; /* ETIMEDOUT: time for the next beat */
            }
        }
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* Stop the thread and wait until it has ended, then close the socket (GIL held,
 * released while waiting). Idempotent; every caller returns once it has ended. */
static void
Beat_stop(Beat *self)
{
    if (self->owner != getpid()) {
        /* A forked child: the thread is not in this process, and mu may have been
         * held by it at the fork. Only our copy of the fd is ours to close. */
        self->running = 0;
    }
    else if (self->sync_ready) {
        pthread_mutex_lock(&self->mu);
        self->stop = 1;
        pthread_cond_broadcast(&self->cv);
        pthread_mutex_unlock(&self->mu);
        if (self->running) {
            self->running = 0;
            Py_BEGIN_ALLOW_THREADS
            pthread_join(self->thread, NULL);
            pthread_mutex_lock(&self->mu);
            self->joined = 1;
            pthread_cond_broadcast(&self->cv);
            pthread_mutex_unlock(&self->mu);
            Py_END_ALLOW_THREADS
        }
        else {
            /* Another caller joins it: wait for that, so that the socket (and NNG,
             * for finalize()) may go once we return. */
            Py_BEGIN_ALLOW_THREADS
            pthread_mutex_lock(&self->mu);
            while (!self->joined) {
                pthread_cond_wait(&self->cv, &self->mu);
            }
            pthread_mutex_unlock(&self->mu);
            Py_END_ALLOW_THREADS
        }
    }
    if (self->fd >= 0) {
        close(self->fd);
        self->fd = -1;
    }
    LIST_UNLINK(self);
}

static PyObject *
Beat_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"frame", "period", "fd", "socket", "watch_tid", "hung_after", NULL};
    Py_buffer frame;
    double period, hung_after = 0.0;
    int fd = -1;
    unsigned long sock_id = 0;
    long watch_tid = 0;
    ext_state *st = (ext_state *)PyType_GetModuleState(type);

    if (st == NULL) {
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*d|$ikld:Beat", kwlist, &frame, &period,
                                     &fd, &sock_id, &watch_tid, &hung_after)) {
        return NULL;
    }
    Beat *self = (Beat *)type->tp_alloc(type, 0);
    if (self == NULL) {
        PyBuffer_Release(&frame);
        if (fd >= 0) {
            close(fd);
        }
        return NULL;
    }
    /* From here on the fd is ours: closed on failure too. */
    self->st = st;
    self->fd = fd;
    self->stat_fd = -1;
    self->d_since = -1;
    self->owner = getpid();
    self->joined = 1;
    self->frame_len = (size_t)frame.len;
    self->frame = frame.len > 0 ? PyMem_RawMalloc((size_t)frame.len) : NULL;
    if (self->frame != NULL) {
        memcpy(self->frame, frame.buf, (size_t)frame.len);
    }
    PyBuffer_Release(&frame);

    if (self->frame_len == 0 || self->frame == NULL) {
        if (self->frame_len == 0) {
            PyErr_SetString(PyExc_ValueError, "frame must not be empty");
        }
        else {
            PyErr_NoMemory();
        }
        goto fail;
    }
    if (!(period >= 0.001 && period <= 86400.0)) {
        PyErr_SetString(PyExc_ValueError, "period must be between 0.001 and 86400 seconds");
        goto fail;
    }
    if (!(hung_after >= 0.0 && hung_after <= 86400.0)) {
        PyErr_SetString(PyExc_ValueError, "hung_after must be between 0 and 86400 seconds");
        goto fail;
    }
    if ((fd >= 0) == (sock_id != 0)) {
        PyErr_SetString(PyExc_ValueError, "give one of fd= (a stream socket) or socket= (NNG)");
        goto fail;
    }
    if (sock_id != 0) {
        if (amesh_require_bound(st) < 0) {
            goto fail;
        }
        if (sock_id > UINT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "socket must be an NNG socket id");
            goto fail;
        }
        self->nsock.id = (uint32_t)sock_id;
    }
#ifdef SO_NOSIGPIPE
    if (fd >= 0) {
        int one = 1;
        (void)setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof(one));
    }
#endif
    self->period_ns = (int64_t)(period * 1e9);
    self->hung_ns = (int64_t)(hung_after * 1e9);
    if (watch_tid > 0 && hung_after > 0.0) {
        char path[64];
        snprintf(path, sizeof(path), "/proc/self/task/%ld/stat", watch_tid);
        self->stat_fd = open(path, O_RDONLY | O_CLOEXEC); /* -1: not watched */
    }

    pthread_condattr_t cattr;
    if (pthread_condattr_init(&cattr) != 0) {
        PyErr_NoMemory();
        goto fail;
    }
#if !defined(__APPLE__)
    pthread_condattr_setclock(&cattr, CLOCK_MONOTONIC);
#endif
    if (pthread_mutex_init(&self->mu, NULL) != 0) {
        pthread_condattr_destroy(&cattr);
        PyErr_NoMemory();
        goto fail;
    }
    if (pthread_cond_init(&self->cv, &cattr) != 0) {
        pthread_condattr_destroy(&cattr);
        pthread_mutex_destroy(&self->mu);
        PyErr_NoMemory();
        goto fail;
    }
    pthread_condattr_destroy(&cattr);
    self->sync_ready = 1;

    /* The thread takes no signal: they are for the main thread. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    self->joined = 0;
    int rc = pthread_create(&self->thread, NULL, beat_main, self);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        self->joined = 1;
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    self->running = 1;
    if (sock_id != 0) { /* finalize() must stop it before NNG goes */
        LIST_PUSH(st->beats, self);
    }
    return (PyObject *)self;

fail:
    Py_DECREF(self);
    return NULL;
}

static void
Beat_dealloc(Beat *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Beat_stop(self);
    if (self->stat_fd >= 0) {
        close(self->stat_fd);
    }
    if (self->sync_ready && self->owner == getpid()) {
        pthread_cond_destroy(&self->cv);
        pthread_mutex_destroy(&self->mu);
    }
    PyMem_RawFree(self->frame);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *
Beat_close(Beat *self, PyObject *unused)
{
    Beat_stop(self);
    Py_RETURN_NONE;
}

/* The counters and flags, read under mu (the thread never holds it across a call). */
typedef struct {
    unsigned long long sent, dropped, withheld;
    int error, hung;
} beat_state;

static beat_state
beat_read(Beat *self)
{
    beat_state out;
    int locked = self->sync_ready && self->owner == getpid();
    if (locked) {
        pthread_mutex_lock(&self->mu);
    }
    out.sent = self->sent;
    out.dropped = self->dropped;
    out.withheld = self->withheld;
    out.error = self->error;
    out.hung = self->hung;
    if (locked) {
        pthread_mutex_unlock(&self->mu);
    }
    return out;
}

static PyObject *
Beat_get_sent(Beat *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(beat_read(self).sent);
}

static PyObject *
Beat_get_dropped(Beat *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(beat_read(self).dropped);
}

static PyObject *
Beat_get_withheld(Beat *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(beat_read(self).withheld);
}

static PyObject *
Beat_get_error(Beat *self, void *closure)
{
    return PyLong_FromLong(beat_read(self).error);
}

static PyObject *
Beat_get_broken(Beat *self, void *closure)
{
    return PyBool_FromLong(beat_read(self).error != 0);
}

static PyObject *
Beat_get_hung(Beat *self, void *closure)
{
    return PyBool_FromLong(beat_read(self).hung);
}

static PyObject *
Beat_get_watching(Beat *self, void *closure)
{
    return PyBool_FromLong(self->stat_fd >= 0);
}

static PyGetSetDef Beat_getset[] = {
    {"sent", (getter)Beat_get_sent, NULL, "Beats written (or begun) so far.", NULL},
    {"dropped", (getter)Beat_get_dropped, NULL,
     "Beats dropped because the connection could not take them at once.", NULL},
    {"withheld", (getter)Beat_get_withheld, NULL,
     "Beats not sent because the watched thread was hung in the kernel.", NULL},
    {"error", (getter)Beat_get_error, NULL,
     "0, or the errno (the NNG error, for an NNG socket) of the send that broke.", NULL},
    {"broken", (getter)Beat_get_broken, NULL,
     "Whether a send failed for good: the thread has ended; connect again.", NULL},
    {"hung", (getter)Beat_get_hung, NULL,
     "Whether the last beat was withheld because the watched thread is hung.", NULL},
    {"watching", (getter)Beat_get_watching, NULL,
     "Whether the state of watch_tid is looked at (Linux, with hung_after > 0).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Beat_methods[] = {
    {"close", (PyCFunction)Beat_close, METH_NOARGS,
     "Stop the thread, wait until it has ended, close the socket's fd; idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Beat_slots[] = {
    {Py_tp_doc,
     "Beat(frame, period, *, fd=-1, socket=0, watch_tid=0, hung_after=0.0): a thread\n"
     "that never takes the GIL writes frame every period seconds to a connected\n"
     "stream socket (fd, which it owns from now on) or an NNG socket (socket id)."},
    {Py_tp_new, Beat_new},
    {Py_tp_dealloc, Beat_dealloc},
    {Py_tp_methods, Beat_methods},
    {Py_tp_getset, Beat_getset},
    {0, NULL},
};

static PyType_Spec Beat_spec = {
    .name = "amesh._native._ext.Beat",
    .basicsize = sizeof(Beat),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Beat_slots,
};

/* For tests: the calling thread sleeps in the kernel, uninterruptibly, as a vfork
 * parent does until its child exits (its state reads 'D'). The child sleeps for
 * `seconds`, and dies with this thread's process. Linux only. */
static PyObject *
ext_wait_uninterruptibly(PyObject *module, PyObject *arg)
{
#ifdef __linux__
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (!(seconds >= 0.0 && seconds <= 3600.0)) {
        PyErr_SetString(PyExc_ValueError, "seconds must be between 0 and 3600");
        return NULL;
    }
    const struct timespec nap = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    const pid_t parent = getpid();
    sigset_t all, old;
    sigfillset(&all);
    pid_t child;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the child runs no handler of ours */
    child = vfork();
    if (child == 0) {
        /* The child borrows this thread's memory until it exits: system calls only. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (getppid() == parent) {
            nanosleep(&nap, NULL);
        }
        _exit(0);
    }
    err = child < 0 ? errno : 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (child > 0) {
        while (waitpid(child, NULL, 0) < 0 && errno == EINTR) {
        }
    }
    Py_END_ALLOW_THREADS
    if (child < 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
#else
    PyErr_SetString(PyExc_NotImplementedError, "Linux only");
    return NULL;
#endif
}

/* finalize() (nng.c): every Beat on an NNG socket stops before NNG goes. */
void
amesh_stop_nng_beats(ext_state *st)
{
    while (st->beats != NULL) { /* Beat_stop() takes it off the list */
        Beat *b = st->beats;
        Py_INCREF(b);
        Beat_stop(b);
        Py_DECREF(b);
    }
}

static PyMethodDef beat_functions[] = {
    {"_wait_uninterruptibly", (PyCFunction)ext_wait_uninterruptibly, METH_O,
     "_wait_uninterruptibly(seconds): for tests, sleep in the kernel in state D."},
    {NULL, NULL, 0, NULL},
};

int
amesh_exec_beat(PyObject *module, ext_state *st)
{
    st->BeatType = amesh_add_type(module, &Beat_spec);
    if (st->BeatType == NULL) {
        return -1;
    }
    return PyModule_AddFunctions(module, beat_functions);
}
