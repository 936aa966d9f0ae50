/*
 * amesh._native._ext's NNG bridge: a thin companion to pynng for amesh's NNG transport.
 *
 * pynng already loads NNG (statically linked into its cffi module). This module
 * links against nothing: it declares the few NNG types and prototypes it needs
 * (amesh_ext.h) and receives the functions' addresses from Python (bind()), which
 * takes them from pynng's cffi module. So there is exactly one NNG in the process.
 *
 * What it adds over pynng:
 *
 * - Receiver: keeps one receive posted on a socket. Its completion callback runs
 *   on an NNG thread WITHOUT the GIL: it only locks a C mutex, appends the
 *   nng_msg* to a bounded ring, re-posts the receive, and writes to an eventfd
 *   (a pipe off Linux) on the not-signalled -> signalled transition. The event
 *   loop waits on that fd and drains the ring in batches.
 * - Message: owns one received nng_msg* and exposes its body through the buffer
 *   protocol (no copy); the nng_msg is freed when the Message and every view of
 *   it are gone. Its ``pipe`` is the id of the connection it came in on, so that
 *   the caller can tell which peer sent it (and drop what an unproven one sent).
 * - send(): copies a buffer (or several, back to back) into a new nng_msg and
 *   hands it to NNG without waiting: nng_sendmsg with NNG_FLAG_NONBLOCK, which
 *   says "full" (False) at once. nng_send_aio was measured no cheaper for the
 *   caller and can only report "full" later, from an NNG thread; the wall time
 *   of a send is mostly preemption by the threads it wakes, not waiting.
 * - finalize(): at exit, before amesh closes every NNG socket (it does not call
 *   nng_fini(), see amesh._transport._nng_pipes), every Receiver is stopped and
 *   its aio freed, and every Beat on an NNG socket (beat.c) stopped; afterwards
 *   nothing here calls NNG again.
 *
 * Every call that may take an NNG lock runs with the GIL released: pynng's pipe
 * callbacks take the GIL on NNG threads, so holding it across an NNG call could
 * deadlock.
 */

#include "amesh_ext.h"

/* Names for bind(), in the order of the fields of nng_api. */
static const char *const api_names[] = {
    "nng_aio_alloc",  "nng_aio_free",    "nng_aio_stop", "nng_aio_set_timeout",
    "nng_aio_result", "nng_aio_get_msg", "nng_recv_aio", "nng_sendmsg",
    "nng_msg_alloc",  "nng_msg_free",    "nng_msg_body", "nng_msg_len",
    "nng_strerror",   "nng_msg_get_pipe",
};
#define API_COUNT (sizeof(api_names) / sizeof(api_names[0]))
_Static_assert(sizeof(nng_api) == API_COUNT * sizeof(void *), "api_names matches nng_api");

PyObject *
amesh_raise_nng(ext_state *st, int rv)
{
    const char *text = st->bound ? st->api.strerror(rv) : "NNG error";
    PyObject *args = Py_BuildValue("(is)", rv, text);
    if (args != NULL) {
        PyErr_SetObject(st->NngError, args);
        Py_DECREF(args);
    }
    return NULL;
}

int
amesh_require_bound(ext_state *st)
{
    if (!st->bound) {
        PyErr_SetString(PyExc_RuntimeError, "amesh._native._ext: call bind() first");
        return -1;
    }
    if (st->finalized) {
        PyErr_SetString(PyExc_RuntimeError, "amesh._native._ext: NNG was finalized");
        return -1;
    }
    return 0;
}

/* ========================================================================== */
/* Wake-up fd: an eventfd on Linux, a non-blocking pipe elsewhere             */
/* ========================================================================== */

static int
wakefd_open(int *rfd, int *wfd)
{
#ifdef __linux__
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) {
        return -1;
    }
    *rfd = *wfd = fd;
#else
    int fds[2];
    if (pipe(fds) != 0) {
        return -1;
    }
    for (int i = 0; i < 2; i++) {
        int fl = fcntl(fds[i], F_GETFL);
        if (fl < 0 || fcntl(fds[i], F_SETFL, fl | O_NONBLOCK) != 0 ||
            fcntl(fds[i], F_SETFD, FD_CLOEXEC) != 0) {
            close(fds[0]);
            close(fds[1]);
            return -1;
        }
    }
    *rfd = fds[0];
    *wfd = fds[1];
#endif
    return 0;
}

/* Called on NNG threads: no Python here. A full pipe is already readable. */
static void
wakefd_signal(int wfd)
{
#ifdef __linux__
    uint64_t one = 1;
    ssize_t n = write(wfd, &one, sizeof(one));
#else
    char one = 1;
    ssize_t n = write(wfd, &one, 1);
#endif
    (void)n;
}

static void
wakefd_clear(int rfd)
{
#ifdef __linux__
    uint64_t count;
    ssize_t n = read(rfd, &count, sizeof(count));
    (void)n;
#else
    char buf[64];
    while (read(rfd, buf, sizeof(buf)) > 0) {
    }
#endif
}

static void
wakefd_close(int rfd, int wfd)
{
    if (rfd >= 0) {
        close(rfd);
    }
    if (wfd >= 0 && wfd != rfd) {
        close(wfd);
    }
}

/* ========================================================================== */
/* Message: one received nng_msg, exposed through the buffer protocol         */
/* ========================================================================== */

typedef struct {
    PyObject_HEAD
    ext_state *st; /* the module outlives us: our type holds a reference to it */
    nng_msg *msg;
    char *body;
    Py_ssize_t len;
    unsigned int pipe; /* the id of the pipe it came in on (the caller's policy) */
} Message;

static char empty_body[1];

static PyObject *
Message_wrap(ext_state *st, nng_msg *msg)
{
    Message *self = PyObject_New(Message, st->MessageType);
    if (self == NULL) {
        return NULL;
    }
    self->st = st;
    self->msg = msg;
    self->len = (Py_ssize_t)st->api.msg_len(msg);
    self->body = self->len ? (char *)st->api.msg_body(msg) : empty_body;
    self->pipe = st->api.msg_get_pipe(msg).id;
    return (PyObject *)self;
}

static void
Message_dealloc(Message *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    /* A buffer export holds a reference to self, so no view outlives this. After
     * finalize() the message is left to the process exit. */
    if (!self->st->finalized) {
        self->st->api.msg_free(self->msg);
    }
    PyObject_Free(self);
    Py_DECREF(tp);
}

static int
Message_getbuffer(Message *self, Py_buffer *view, int flags)
{
    /* Writable: the message belongs to this object alone, so arrays and tensors
     * unpickled onto it may be mutated in place without a copy. */
    return PyBuffer_FillInfo(view, (PyObject *)self, self->body, self->len, 0, flags);
}

static Py_ssize_t
Message_len(Message *self)
{
    return self->len;
}

static PyMemberDef Message_members[] = {
    {"pipe", T_UINT, offsetof(Message, pipe), READONLY,
     "The id of the NNG pipe (connection) the message came in on."},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot Message_slots[] = {
    {Py_tp_doc, "One received NNG message; its body is readable through memoryview()."},
    {Py_tp_members, Message_members},
    {Py_tp_dealloc, Message_dealloc},
    {Py_bf_getbuffer, Message_getbuffer},
    {Py_sq_length, Message_len},
    {0, NULL},
};

static PyType_Spec Message_spec = {
    .name = "amesh._native._ext.Message",
    .basicsize = sizeof(Message),
    /* Made only by Receiver.drain(). */
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Message_slots,
};

/* ========================================================================== */
/* Receiver: a posted receive feeding a bounded ring, drained from Python     */
/* ========================================================================== */

/* Messages moved out of the ring per lock hold in drain(). */
#define DRAIN_CHUNK 64

typedef struct Receiver {
    PyObject_HEAD
    ext_state *st; /* the module outlives us: our type holds a reference to it */
    struct Receiver **pprev, *next; /* in st->live while it owns an aio */
    nng_socket sock;
    nng_aio *aio;
    pthread_mutex_t mu;
    int mu_ready;
    int in_stop; /* threads inside nng_aio_stop() (guarded by the GIL) */
    /* Everything below is guarded by mu. */
    nng_msg **ring;
    size_t cap, head, count;
    int started;   /* start() was called */
    int armed;     /* a receive is posted, or its callback is running */
    int signalled; /* the fd was written and not cleared since */
    int closed;    /* close() was called: never post again */
    int result;    /* 0, or the NNG error that stopped receiving */
    int rfd, wfd;
} Receiver;

/* The aio callback, on an NNG thread, without the GIL. */
static void
Receiver_on_recv(void *arg)
{
    Receiver *self = (Receiver *)arg;
    const nng_api *api = &self->st->api;
    int rv = api->aio_result(self->aio);
    nng_msg *msg = rv == 0 ? api->aio_get_msg(self->aio) : NULL;
    int wake = 0, repost = 0;

    pthread_mutex_lock(&self->mu);
    if (rv == 0 && self->closed) {
        api->msg_free(msg);
        self->armed = 0;
    }
    else if (rv == 0) {
        /* Receives are posted only while count < cap, one at a time. */
        self->ring[(self->head + self->count) % self->cap] = msg;
        self->count++;
        if (self->count < self->cap) {
            repost = 1;
        }
        else {
            self->armed = 0; /* parked: drain() posts again */
        }
    }
    else {
        self->armed = 0;
        if (self->result == 0) {
            self->result = rv;
        }
    }
    if (!self->signalled && (rv != 0 || !self->closed)) {
        self->signalled = 1;
        wake = 1;
    }
    pthread_mutex_unlock(&self->mu);

    if (wake) {
        wakefd_signal(self->wfd);
    }
    if (repost) {
        api->recv_aio(self->sock, self->aio);
    }
}

static PyObject *
Receiver_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"socket", "capacity", NULL};
    unsigned long sock_id;
    Py_ssize_t capacity;
    ext_state *st = (ext_state *)PyType_GetModuleState(type);

    if (st == NULL || amesh_require_bound(st) < 0) {
        return NULL;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "kn:Receiver", kwlist, &sock_id, &capacity)) {
        return NULL;
    }
    if (sock_id == 0 || sock_id > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "socket must be an NNG socket id");
        return NULL;
    }
    if (capacity < 1) {
        PyErr_SetString(PyExc_ValueError, "capacity must be at least 1");
        return NULL;
    }

    Receiver *self = (Receiver *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->st = st;
    self->sock.id = (uint32_t)sock_id;
    self->cap = (size_t)capacity;
    self->rfd = self->wfd = -1;
    if (pthread_mutex_init(&self->mu, NULL) != 0) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->mu_ready = 1;
    self->ring = PyMem_RawCalloc(self->cap, sizeof(nng_msg *));
    if (self->ring == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    if (wakefd_open(&self->rfd, &self->wfd) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    int rv = st->api.aio_alloc(&self->aio, Receiver_on_recv, self);
    if (rv != 0) {
        self->aio = NULL;
        Py_DECREF(self);
        return amesh_raise_nng(st, rv);
    }
    /* Not the socket's receive timeout: a posted receive waits for a message. */
    st->api.aio_set_timeout(self->aio, NNG_DURATION_INFINITE);
    LIST_PUSH(st->live, self);
    return (PyObject *)self;
}

static PyObject *
Receiver_start(Receiver *self, PyObject *unused)
{
    pthread_mutex_lock(&self->mu);
    int ok = !self->started && !self->closed;
    if (ok) {
        self->started = 1;
        self->armed = 1;
    }
    pthread_mutex_unlock(&self->mu);
    if (!ok) {
        PyErr_SetString(PyExc_RuntimeError, "Receiver was already started or closed");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    self->st->api.recv_aio(self->sock, self->aio);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
Receiver_fileno(Receiver *self, PyObject *unused)
{
    return PyLong_FromLong(self->rfd);
}

/* Free the messages of chunk[from:n] (after a failed allocation). */
static void
free_chunk(const nng_api *api, nng_msg **chunk, size_t from, size_t n)
{
    for (size_t i = from; i < n; i++) {
        api->msg_free(chunk[i]);
    }
}

static PyObject *
Receiver_drain(Receiver *self, PyObject *arg)
{
    ext_state *st = self->st;
    Py_ssize_t max = PyLong_AsSsize_t(arg);
    if (max == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (max < 1) {
        PyErr_SetString(PyExc_ValueError, "max must be at least 1");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    nng_msg *chunk[DRAIN_CHUNK];
    int result = 0;
    amesh_intakes++;
    for (;;) {
        size_t want = (size_t)(max - PyList_GET_SIZE(out));
        if (want > DRAIN_CHUNK) {
            want = DRAIN_CHUNK;
        }
        int repost = 0;

        pthread_mutex_lock(&self->mu);
        size_t n = self->count < want ? self->count : want;
        for (size_t i = 0; i < n; i++) {
            chunk[i] = self->ring[self->head];
            self->head = (self->head + 1) % self->cap;
        }
        self->count -= n;
        /* Clear under the lock so that the next push signals again. A stopped
         * receiver stays signalled, so that a waiter sees the error. */
        if (self->count == 0 && self->signalled && self->result == 0) {
            wakefd_clear(self->rfd);
            self->signalled = 0;
        }
        if (self->started && !self->armed && !self->closed && self->result == 0 &&
            self->count < self->cap) {
            self->armed = 1;
            repost = 1;
        }
        result = self->result;
        pthread_mutex_unlock(&self->mu);

        if (repost) {
            Py_BEGIN_ALLOW_THREADS
            st->api.recv_aio(self->sock, self->aio);
            Py_END_ALLOW_THREADS
        }
        for (size_t i = 0; i < n; i++) {
            PyObject *m = Message_wrap(st, chunk[i]);
            if (m == NULL || PyList_Append(out, m) < 0) {
                Py_XDECREF(m); /* frees chunk[i] if it was wrapped */
                free_chunk(&st->api, chunk, m == NULL ? i : i + 1, n);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(m);
        }
        if (n < want || PyList_GET_SIZE(out) >= max) {
            break;
        }
    }
    if (PyList_GET_SIZE(out) == 0 && result != 0) {
        Py_DECREF(out);
        return amesh_raise_nng(st, result);
    }
    return out;
}

/* Stop receiving, wait for a running callback, free queued messages, and leave
 * the fd signalled so that a waiter wakes up and sees NNG_ECLOSED. */
static void
Receiver_stop(Receiver *self)
{
    if (!self->mu_ready) {
        return;
    }
    pthread_mutex_lock(&self->mu);
    int was_closed = self->closed;
    self->closed = 1;
    pthread_mutex_unlock(&self->mu);
    if (self->aio == NULL || self->st->finalized) {
        return;
    }
    /* Every caller waits for the callback to finish, not just the first. */
    self->in_stop++;
    Py_BEGIN_ALLOW_THREADS
    self->st->api.aio_stop(self->aio);
    Py_END_ALLOW_THREADS
    self->in_stop--;
    if (was_closed || self->st->finalized) {
        return;
    }

    pthread_mutex_lock(&self->mu);
    while (self->count > 0) {
        self->st->api.msg_free(self->ring[self->head]);
        self->head = (self->head + 1) % self->cap;
        self->count--;
    }
    self->result = NNG_ECLOSED;
    int wake = !self->signalled;
    self->signalled = 1;
    pthread_mutex_unlock(&self->mu);
    if (wake) {
        wakefd_signal(self->wfd);
    }
}

static PyObject *
Receiver_close(Receiver *self, PyObject *unused)
{
    Receiver_stop(self);
    Py_RETURN_NONE;
}

/* Stop, and give the aio back to NNG (before NNG is finalized). */
static void
Receiver_release(Receiver *self)
{
    Receiver_stop(self);
    /* Another thread still inside close() (only possible at finalize()) keeps
     * using the aio: leave it to the process exit. */
    if (self->aio != NULL && self->in_stop == 0 && !self->st->finalized) {
        self->st->api.aio_free(self->aio);
        self->aio = NULL;
    }
    LIST_UNLINK(self);
}

static void
Receiver_dealloc(Receiver *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Receiver_release(self);
    PyMem_RawFree(self->ring);
    wakefd_close(self->rfd, self->wfd);
    if (self->mu_ready) {
        pthread_mutex_destroy(&self->mu);
    }
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMethodDef Receiver_methods[] = {
    {"start", (PyCFunction)Receiver_start, METH_NOARGS, "Post the first receive."},
    {"fileno", (PyCFunction)Receiver_fileno, METH_NOARGS,
     "The fd that is readable while messages (or an error) wait in the ring."},
    {"drain", (PyCFunction)Receiver_drain, METH_O,
     "Take up to max messages from the ring; raise NngError once stopped and empty."},
    {"close", (PyCFunction)Receiver_close, METH_NOARGS,
     "Stop receiving and free queued messages; idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Receiver_slots[] = {
    {Py_tp_doc, "Receiver(socket, capacity): a receive kept posted on an NNG socket."},
    {Py_tp_new, Receiver_new},
    {Py_tp_dealloc, Receiver_dealloc},
    {Py_tp_methods, Receiver_methods},
    {0, NULL},
};

static PyType_Spec Receiver_spec = {
    .name = "amesh._native._ext.Receiver",
    .basicsize = sizeof(Receiver),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Receiver_slots,
};

/* ========================================================================== */
/* bind(), send(), finalize()                                                  */
/* ========================================================================== */

static PyObject *
ext_bind(PyObject *module, PyObject *functions)
{
    ext_state *st = get_state(module);
    void *found[API_COUNT];

    if (!PyDict_Check(functions)) {
        PyErr_SetString(PyExc_TypeError, "bind() takes a dict of name -> address");
        return NULL;
    }
    for (size_t i = 0; i < API_COUNT; i++) {
        PyObject *addr = PyDict_GetItemString(functions, api_names[i]);
        if (addr == NULL) {
            PyErr_Format(PyExc_KeyError, "bind(): missing %s", api_names[i]);
            return NULL;
        }
        found[i] = PyLong_AsVoidPtr(addr);
        if (found[i] == NULL) {
            if (!PyErr_Occurred()) {
                PyErr_Format(PyExc_ValueError, "bind(): %s is NULL", api_names[i]);
            }
            return NULL;
        }
    }
    /* Receivers and Messages point at the table: it may be set once, or again
     * with the same values. */
    if (st->bound) {
        if (memcmp(found, &st->api, sizeof(found)) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "bind(): already bound to other functions");
            return NULL;
        }
        Py_RETURN_NONE;
    }
    memcpy(&st->api, found, sizeof(found));
    st->bound = 1;
    Py_RETURN_NONE;
}

/* Parts of a frame held in place without allocating. */
#define SEND_INLINE_PARTS 8

static PyObject *
ext_send(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    ext_state *st = get_state(module);
    if (amesh_require_bound(st) < 0) {
        return NULL;
    }
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "send(socket, data) takes 2 arguments");
        return NULL;
    }
    unsigned long sock_id = PyLong_AsUnsignedLong(args[0]);
    if (sock_id == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (sock_id == 0 || sock_id > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "socket must be an NNG socket id");
        return NULL;
    }

    /* One buffer, or an iterable of buffers sent back to back as one message. */
    PyObject *data = args[1];
    PyObject *seq = NULL;
    Py_ssize_t nparts = 1;
    Py_buffer inline_views[SEND_INLINE_PARTS];
    Py_buffer *views = inline_views;
    if (!PyObject_CheckBuffer(data)) {
        seq = PySequence_Fast(data, "send(): data must be a buffer or buffers");
        if (seq == NULL) {
            return NULL;
        }
        nparts = PySequence_Fast_GET_SIZE(seq);
        if (nparts > SEND_INLINE_PARTS) {
            views = PyMem_New(Py_buffer, (size_t)nparts);
            if (views == NULL) {
                Py_DECREF(seq);
                return PyErr_NoMemory();
            }
        }
    }
    Py_ssize_t held = 0;
    size_t total = 0;
    int rv = -1;
    for (; held < nparts; held++) {
        PyObject *part = seq != NULL ? PySequence_Fast_GET_ITEM(seq, held) : data;
        if (PyObject_GetBuffer(part, &views[held], PyBUF_SIMPLE) < 0) {
            goto done;
        }
        total += (size_t)views[held].len;
    }

    nng_socket sock = {(uint32_t)sock_id};
    nng_msg *msg = NULL;
    /* The views pin the buffers while the GIL is released. */
    Py_BEGIN_ALLOW_THREADS
    rv = st->api.msg_alloc(&msg, total);
    if (rv == 0) {
        char *body = total > 0 ? (char *)st->api.msg_body(msg) : NULL;
        for (Py_ssize_t i = 0; i < nparts; i++) {
            if (views[i].len > 0) {
                memcpy(body, views[i].buf, (size_t)views[i].len);
                body += views[i].len;
            }
        }
        rv = st->api.sendmsg(sock, msg, NNG_FLAG_NONBLOCK);
        if (rv != 0) {
            st->api.msg_free(msg); /* NNG takes ownership only on success */
        }
    }
    Py_END_ALLOW_THREADS

done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(&views[i]);
    }
    if (views != inline_views) {
        PyMem_Free(views);
    }
    Py_XDECREF(seq);
    if (rv < 0) {
        return NULL; /* a part was not a buffer */
    }
    if (rv == 0) {
        Py_RETURN_TRUE;
    }
    if (rv == NNG_EAGAIN) {
        Py_RETURN_FALSE;
    }
    return amesh_raise_nng(st, rv);
}

static PyObject *
ext_finalize(PyObject *module, PyObject *unused)
{
    ext_state *st = get_state(module);
    if (st->bound && !st->finalized) {
        while (st->live != NULL) {
            Receiver_release(st->live);
        }
        amesh_stop_nng_beats(st);
        st->finalized = 1;
    }
    Py_RETURN_NONE;
}

static PyMethodDef nng_functions[] = {
    {"bind", (PyCFunction)ext_bind, METH_O,
     "bind(functions): the addresses of NNG_FUNCTIONS in the loaded NNG."},
    {"send", (PyCFunction)(void (*)(void))ext_send, METH_FASTCALL,
     "send(socket, data): hand a copy of data (a buffer, or an iterable of\n"
     "buffers joined back to back) to NNG without waiting; False if full."},
    {"finalize", (PyCFunction)ext_finalize, METH_NOARGS,
     "Stop every Receiver and NNG Beat, and make no more NNG calls (run at exit, before the sockets close)."},
    {NULL, NULL, 0, NULL},
};

int
amesh_exec_nng(PyObject *module, ext_state *st)
{
    st->NngError = PyErr_NewExceptionWithDoc(
        "amesh._native._ext.NngError", "An NNG error: args are (errno, strerror).", PyExc_OSError, NULL);
    if (st->NngError == NULL || PyModule_AddObjectRef(module, "NngError", st->NngError) < 0) {
        return -1;
    }
    if ((st->MessageType = amesh_add_type(module, &Message_spec)) == NULL ||
        (st->ReceiverType = amesh_add_type(module, &Receiver_spec)) == NULL ||
        PyModule_AddFunctions(module, nng_functions) < 0) {
        return -1;
    }
    PyObject *names = PyTuple_New(API_COUNT);
    if (names == NULL) {
        return -1;
    }
    for (size_t i = 0; i < API_COUNT; i++) {
        PyObject *s = PyUnicode_FromString(api_names[i]);
        if (s == NULL) {
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, i, s);
    }
    if (PyModule_AddObject(module, "NNG_FUNCTIONS", names) < 0) {
        Py_DECREF(names);
        return -1;
    }
    if (PyModule_AddIntConstant(module, "NNG_EAGAIN", NNG_EAGAIN) < 0 ||
        PyModule_AddIntConstant(module, "NNG_ECLOSED", NNG_ECLOSED) < 0) {
        return -1;
    }
    return 0;
}
