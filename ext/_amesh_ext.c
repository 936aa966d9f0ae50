/*
 * amesh._ext: a thin companion to pynng for amesh's NNG transport.
 *
 * pynng already loads NNG (statically linked into its cffi module). This file
 * links against nothing: it declares the few NNG types and prototypes it needs
 * and receives the functions' addresses from Python (bind()), which takes them
 * from pynng's cffi module. So there is exactly one NNG in the process.
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
 *   its aio freed; afterwards nothing here calls NNG again.
 *
 * And, apart from NNG:
 *
 * - Beat: a thread of its own that writes a worker's heartbeat every period to a
 *   connected stream socket (or an NNG socket) and never takes the GIL, so that a
 *   main thread holding the GIL for long (one long C call) is not declared dead.
 *   It withholds the beats once the main thread has been in uninterruptible
 *   sleep (state D, read from /proc) for longer than it is told.
 *
 * - cut_frames(): the stream transport's reader (amesh._transport._stream_wire)
 *   cuts the whole frames out of what a read brought, in one call per read
 *   rather than a Python loop per frame.
 * - FrameReader: that whole reader, so that the event loop's read callbacks on a
 *   proven inbound connection run no Python code until a frame is handed over.
 * - FrameWriter: the write side of an outbound connection on asyncio, for small
 *   frames: each written at once (one writev with its length), or batched to the
 *   end of the loop's turn, with no Python code of ours in between.
 * - EnvelopeDecoder, EnvelopeEncoder: a frame's preamble, envelope (through
 *   msgspec), checks and out-of-band buffers in one call each way, for every
 *   transport (amesh._wire.try_decode and encode_envelope); a frame they do not
 *   take is left to the Python decoder, which says what is wrong with it.
 *
 * - exit_when_closed(): a worker's watch of the pipe its parent holds, as a bare
 *   thread that ends the process when the pipe closes; set_parent_death_signal():
 *   the kernel's half of that watch, without ctypes.
 * - line_buffer_stdout(), flush_stdio(): C's stdio, for a worker whose fds 1 and 2
 *   are pipes to its output capture, without ctypes.
 *
 * - pread_bytes(), copy_bytes(): a large bytes payload read out of shared memory
 *   (amesh._codec) goes into a bytes object the process already has and nobody
 *   references any more, rather than into fresh pages; copy_bytes() copies out of
 *   a mapping the receiver keeps, with the GIL released.
 *
 * Policy (batch sizes, ring capacity, what an error means, when to wait) is the
 * caller's. Every call that may take an NNG lock runs with the GIL released:
 * pynng's pipe callbacks take the GIL on NNG threads, so holding it across an
 * NNG call could deadlock.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifdef __linux__
#include <sys/eventfd.h>
#include <sys/prctl.h>
#endif

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0 /* SO_NOSIGPIPE is set on the socket instead */
#endif

/* ========================================================================== */
/* NNG declarations (the subset of nng.h used here; ABI of NNG 1.x)            */
/* ========================================================================== */

typedef struct nng_socket_s {
    uint32_t id;
} nng_socket;

typedef struct nng_pipe_s {
    uint32_t id;
} nng_pipe;

typedef struct nng_aio nng_aio; /* opaque */
typedef struct nng_msg nng_msg; /* opaque */

typedef int32_t nng_duration;

#define NNG_FLAG_NONBLOCK 2
#define NNG_DURATION_INFINITE (-1)

/* Intrusive lists of live objects (Receivers, Beats) that finalize() must stop: each
 * node has `pprev` (the pointer that points at it) and `next`. GIL held. */
#define LIST_PUSH(head, node)                                                          \
    do {                                                                               \
        (node)->next = (head);                                                         \
        if ((head) != NULL) {                                                          \
            (head)->pprev = &(node)->next;                                             \
        }                                                                              \
        (node)->pprev = &(head);                                                       \
        (head) = (node);                                                               \
    } while (0)
#define LIST_UNLINK(node)                                                              \
    do {                                                                               \
        if ((node)->pprev != NULL) {                                                   \
            *(node)->pprev = (node)->next;                                             \
            if ((node)->next != NULL) {                                                \
                (node)->next->pprev = (node)->pprev;                                   \
            }                                                                          \
            (node)->pprev = NULL;                                                      \
            (node)->next = NULL;                                                       \
        }                                                                              \
    } while (0)

#define NNG_EAGAIN 8
#define NNG_ECLOSED 7

/* How many times this process took in messages: a FrameReader's reads and a
 * Receiver's drains (see FrameWriter.send). */
static unsigned long long intakes;

typedef struct {
    int (*aio_alloc)(nng_aio **, void (*)(void *), void *);
    void (*aio_free)(nng_aio *);
    void (*aio_stop)(nng_aio *);
    void (*aio_set_timeout)(nng_aio *, nng_duration);
    int (*aio_result)(nng_aio *);
    nng_msg *(*aio_get_msg)(nng_aio *);
    void (*recv_aio)(nng_socket, nng_aio *);
    int (*sendmsg)(nng_socket, nng_msg *, int);
    int (*msg_alloc)(nng_msg **, size_t);
    void (*msg_free)(nng_msg *);
    void *(*msg_body)(nng_msg *);
    size_t (*msg_len)(const nng_msg *);
    const char *(*strerror)(int);
    nng_pipe (*msg_get_pipe)(const nng_msg *);
} nng_api;

/* Names for bind(), in the order of the fields of nng_api. */
static const char *const api_names[] = {
    "nng_aio_alloc",  "nng_aio_free",    "nng_aio_stop", "nng_aio_set_timeout",
    "nng_aio_result", "nng_aio_get_msg", "nng_recv_aio", "nng_sendmsg",
    "nng_msg_alloc",  "nng_msg_free",    "nng_msg_body", "nng_msg_len",
    "nng_strerror",   "nng_msg_get_pipe",
};
#define API_COUNT (sizeof(api_names) / sizeof(api_names[0]))
_Static_assert(sizeof(nng_api) == API_COUNT * sizeof(void *), "api_names matches nng_api");

/* ========================================================================== */
/* Module state                                                                */
/* ========================================================================== */

struct Receiver;
struct Beat;

typedef struct {
    nng_api api;
    int bound;
    int finalized;         /* finalize() ran: NNG is going away, call it no more */
    struct Receiver *live; /* every Receiver with an aio, for finalize() (GIL) */
    struct Beat *beats;    /* every Beat whose thread may call NNG, for finalize() (GIL) */
    PyObject *NngError;
    PyTypeObject *MessageType;
    PyTypeObject *ReceiverType;
    PyTypeObject *BeatType;
    PyTypeObject *FrameReaderType;
    PyTypeObject *FrameWriterType;
    PyTypeObject *EnvelopeDecoderType;
    PyTypeObject *EnvelopeEncoderType;
} ext_state;

static inline ext_state *
get_state(PyObject *module)
{
    return (ext_state *)PyModule_GetState(module);
}

static PyObject *
raise_nng(ext_state *st, int rv)
{
    const char *text = st->bound ? st->api.strerror(rv) : "NNG error";
    PyObject *args = Py_BuildValue("(is)", rv, text);
    if (args != NULL) {
        PyErr_SetObject(st->NngError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static int
require_bound(ext_state *st)
{
    if (!st->bound) {
        PyErr_SetString(PyExc_RuntimeError, "amesh._ext: call bind() first");
        return -1;
    }
    if (st->finalized) {
        PyErr_SetString(PyExc_RuntimeError, "amesh._ext: NNG was finalized");
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
    .name = "amesh._ext.Message",
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

    if (st == NULL || require_bound(st) < 0) {
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
        return raise_nng(st, rv);
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
    intakes++;
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
        return raise_nng(st, result);
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
    .name = "amesh._ext.Receiver",
    .basicsize = sizeof(Receiver),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Receiver_slots,
};

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
        if (require_bound(st) < 0) {
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
    .name = "amesh._ext.Beat",
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

/* ========================================================================== */
/* Module functions                                                            */
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
    if (require_bound(st) < 0) {
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
    return raise_nng(st, rv);
}

static PyObject *
ext_finalize(PyObject *module, PyObject *unused)
{
    ext_state *st = get_state(module);
    if (st->bound && !st->finalized) {
        while (st->live != NULL) {
            Receiver_release(st->live);
        }
        while (st->beats != NULL) { /* Beat_stop() takes it off the list */
            Beat *b = st->beats;
            Py_INCREF(b);
            Beat_stop(b);
            Py_DECREF(b);
        }
        st->finalized = 1;
    }
    Py_RETURN_NONE;
}

/* ========================================================================== */
/* Stream framing (the default transport within a host)                        */
/* ========================================================================== */

/*
 * cut_frames(buffer, start, end, limit) -> (frames, pos, size)
 *
 * The stream transport's frames are a 4-byte little-endian length and that many
 * bytes. This cuts every whole frame out of buffer[start:end] into a bytes object
 * of its own (frames, a list) and stops at the first frame that is incomplete or
 * announces more than limit bytes: pos is where that one starts (end if none is
 * left), size the length it announces, or -1 when fewer than 4 bytes are left.
 * What to do then (wait for more, memory of its own for a large frame, refuse the
 * peer, move the rest to the front) is the caller's.
 */
static PyObject *
ext_cut_frames(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "cut_frames(buffer, start, end, limit)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    Py_ssize_t end = PyLong_AsSsize_t(args[2]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[3]);
    if ((start == -1 || end == -1 || limit == -1) && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *frames = NULL;
    if (start < 0 || end < start || end > view.len) {
        PyErr_Format(PyExc_ValueError, "bad range [%zd:%zd] of a buffer of %zd bytes", start,
                     end, view.len);
        goto done;
    }
    frames = PyList_New(0);
    if (frames == NULL) {
        goto done;
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    Py_ssize_t pos = start, size = -1;
    while (end - pos >= 4) {
        const unsigned char *h = p + pos;
        size = (Py_ssize_t)((uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                            (uint32_t)h[3] << 24);
        if (size > limit || end - pos - 4 < size) {
            break;
        }
        PyObject *frame = PyBytes_FromStringAndSize((const char *)h + 4, size);
        if (frame == NULL || PyList_Append(frames, frame) < 0) {
            Py_XDECREF(frame);
            Py_CLEAR(frames);
            goto done;
        }
        Py_DECREF(frame);
        pos += 4 + size;
        size = -1;
    }
    PyBuffer_Release(&view);
    return Py_BuildValue("(Nnn)", frames, pos, size);
done:
    PyBuffer_Release(&view);
    return NULL;
}

/* ========================================================================== */
/* FrameReader: one inbound stream connection's frames, read without Python    */
/* ========================================================================== */

/*
 * FrameReader(max_frame, emit, frame_memory, bad_stream, fail=None)
 *
 * What amesh._transport._stream_wire.Reader does, in C, so that the event loop's
 * read callbacks (get_buffer, buffer_updated: the asyncio BufferedProtocol pair)
 * run no Python code of ours until a whole frame is handed to emit(frame).
 *
 * Small frames (up to SMALL bytes) are read into a buffer of CHUNK bytes that this
 * object owns and cut out of it, each into a bytes of its own. A larger frame gets
 * memory of its own from frame_memory(size) (a writable memoryview), which the socket
 * then reads into directly, and which emit gets whole. No delivered frame's memory is
 * reused. A frame announced larger than max_frame is an error: bad_stream(message)
 * is raised, or, when fail is given, fail(message) is called instead and the read
 * returns (a protocol callback cannot usefully raise into the event loop).
 *
 * stopped (settable): the connection is gone; emit no more frames.
 */

#define FR_CHUNK (64 * 1024)
#define FR_SMALL (16 * 1024)
#define FR_HLEN 4

typedef struct {
    PyObject_HEAD
    char *buf;                /* FR_CHUNK bytes */
    Py_ssize_t start, end;    /* the unread bytes are buf[start:end] */
    PyObject *big;            /* a large frame's memoryview, being filled; or NULL */
    Py_ssize_t big_len, filled;
    Py_ssize_t max;
    PyObject *emit, *frame_memory, *bad_stream, *fail;
    char stopped;
    PyObject *dict;           /* attributes of subclasses (a protocol's connection) */
} FrameReader;

static int
FrameReader_init(FrameReader *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_frame", "emit", "frame_memory", "bad_stream", "fail", NULL};
    Py_ssize_t max;
    PyObject *emit, *frame_memory, *bad_stream, *fail = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nOOO|O:FrameReader", kwlist, &max, &emit,
                                     &frame_memory, &bad_stream, &fail)) {
        return -1;
    }
    if (max < 0) {
        PyErr_SetString(PyExc_ValueError, "max_frame must not be negative");
        return -1;
    }
    if (self->buf == NULL) {
        self->buf = PyMem_Malloc(FR_CHUNK);
        if (self->buf == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    self->start = self->end = 0;
    self->big_len = self->filled = 0;
    self->max = max;
    self->stopped = 0;
    Py_CLEAR(self->big);
    Py_INCREF(emit);
    Py_XSETREF(self->emit, emit);
    Py_INCREF(frame_memory);
    Py_XSETREF(self->frame_memory, frame_memory);
    Py_INCREF(bad_stream);
    Py_XSETREF(self->bad_stream, bad_stream);
    Py_XSETREF(self->fail, fail == Py_None ? NULL : Py_NewRef(fail));
    return 0;
}

static int
FrameReader_traverse(FrameReader *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->big);
    Py_VISIT(self->emit);
    Py_VISIT(self->frame_memory);
    Py_VISIT(self->bad_stream);
    Py_VISIT(self->fail);
    Py_VISIT(self->dict);
    return 0;
}

static int
FrameReader_clear(FrameReader *self)
{
    Py_CLEAR(self->big);
    Py_CLEAR(self->emit);
    Py_CLEAR(self->frame_memory);
    Py_CLEAR(self->bad_stream);
    Py_CLEAR(self->fail);
    Py_CLEAR(self->dict);
    return 0;
}

static void
FrameReader_dealloc(FrameReader *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    FrameReader_clear(self);
    PyMem_Free(self->buf);
    self->buf = NULL;
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* The reusable buffer's free part, buf[end:], as a writable buffer that keeps this
 * object alive (see get_buffer). */
static int
FrameReader_getbuffer(FrameReader *self, Py_buffer *view, int flags)
{
    if (self->buf == NULL) {
        PyErr_SetString(PyExc_ValueError, "FrameReader is not initialized");
        view->obj = NULL;
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, self->buf + self->end,
                             FR_CHUNK - self->end, 0, flags);
}

static PyObject *
FrameReader_get_buffer(FrameReader *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "get_buffer(sizehint=-1)");
        return NULL;
    }
    if (self->big != NULL) {
        PyObject *start = PyLong_FromSsize_t(self->filled);
        if (start == NULL) {
            return NULL;
        }
        PyObject *slice = PySlice_New(start, Py_None, Py_None);
        Py_DECREF(start);
        if (slice == NULL) {
            return NULL;
        }
        PyObject *rest = PyObject_GetItem(self->big, slice);
        Py_DECREF(slice);
        return rest;
    }
    return PyMemoryView_FromObject((PyObject *)self);
}

/* A bad stream: raise bad_stream(message), or call fail(message) and return None. */
static PyObject *
FrameReader_bad(FrameReader *self, PyObject *message)
{
    if (message == NULL) {
        return NULL;
    }
    if (self->fail == NULL) {
        PyErr_SetObject(self->bad_stream, message);
        Py_DECREF(message);
        return NULL;
    }
    PyObject *fail = Py_NewRef(self->fail);
    PyObject *r = PyObject_CallOneArg(fail, message);
    Py_DECREF(fail);
    Py_DECREF(message);
    if (r == NULL) {
        return NULL;
    }
    Py_DECREF(r);
    Py_RETURN_NONE;
}

/* emit(frame); -1 if it raised. */
static int
FrameReader_emit(FrameReader *self, PyObject *frame)
{
    if (self->emit == NULL) { /* stopped */
        return 0;
    }
    PyObject *emit = Py_NewRef(self->emit); /* (emit may replace it meanwhile) */
    PyObject *r = PyObject_CallOneArg(emit, frame);
    Py_DECREF(emit);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

static PyObject *
FrameReader_buffer_updated(FrameReader *self, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (self->stopped || self->buf == NULL) {
        Py_RETURN_NONE;
    }
    intakes++;
    if (self->big != NULL) {
        if (n < 0 || n > self->big_len - self->filled) {
            PyErr_Format(PyExc_ValueError, "%zd bytes read into %zd left", n,
                         self->big_len - self->filled);
            return NULL;
        }
        self->filled += n;
        if (self->filled == self->big_len) {
            PyObject *big = self->big;
            self->big = NULL;
            int rc = FrameReader_emit(self, big);
            Py_DECREF(big);
            if (rc < 0) {
                return NULL;
            }
        }
        Py_RETURN_NONE;
    }
    if (n < 0 || n > FR_CHUNK - self->end) {
        PyErr_Format(PyExc_ValueError, "%zd bytes read into %zd left", n, FR_CHUNK - self->end);
        return NULL;
    }
    Py_INCREF(self); /* emit may let go of this reader */
    PyObject *result = NULL;
    self->end += n;
    Py_ssize_t size = -1;
    while (!self->stopped) {
        Py_ssize_t avail = self->end - self->start;
        if (avail < FR_HLEN) {
            size = -1;
            break;
        }
        const unsigned char *h = (const unsigned char *)self->buf + self->start;
        size = (Py_ssize_t)((uint32_t)h[0] | (uint32_t)h[1] << 8 | (uint32_t)h[2] << 16 |
                            (uint32_t)h[3] << 24);
        if (size > self->max || avail - FR_HLEN < size) {
            break;
        }
        PyObject *frame = PyBytes_FromStringAndSize((const char *)h + FR_HLEN, size);
        if (frame == NULL) {
            goto done;
        }
        self->start += FR_HLEN + size;
        int rc = FrameReader_emit(self, frame);
        Py_DECREF(frame);
        if (rc < 0) {
            goto done;
        }
        size = -1;
    }
    if (self->stopped) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t pos = self->start, end = self->end;
    if (size > self->max) {
        result = FrameReader_bad(
            self, PyUnicode_FromFormat("peer sent a frame of %zd bytes (max_frame %zd)", size,
                                       self->max));
        goto done;
    }
    if (size > FR_SMALL) {
        PyObject *big = PyObject_CallFunction(self->frame_memory, "n", size);
        if (big == NULL) {
            if (self->fail != NULL && PyErr_ExceptionMatches(self->bad_stream)) {
                PyObject *type, *value, *tb;
                PyErr_Fetch(&type, &value, &tb);
                PyErr_NormalizeException(&type, &value, &tb);
                PyObject *message = value != NULL ? PyObject_Str(value) : NULL;
                Py_XDECREF(type);
                Py_XDECREF(value);
                Py_XDECREF(tb);
                result = FrameReader_bad(self, message);
            }
            goto done;
        }
        Py_buffer view;
        if (PyObject_GetBuffer(big, &view, PyBUF_WRITABLE) < 0) {
            Py_DECREF(big);
            goto done;
        }
        Py_ssize_t have = end - pos - FR_HLEN;
        if (view.len != size || have < 0 || have > size) {
            PyBuffer_Release(&view);
            Py_DECREF(big);
            PyErr_Format(PyExc_ValueError, "frame_memory(%zd) gave %zd bytes", size, view.len);
            goto done;
        }
        memcpy(view.buf, self->buf + pos + FR_HLEN, (size_t)have);
        PyBuffer_Release(&view);
        Py_XSETREF(self->big, big);
        self->big_len = size;
        self->filled = have;
        self->start = self->end = 0;
    } else if (pos == end) {
        self->start = self->end = 0;
    } else if (FR_CHUNK - pos < FR_SMALL + FR_HLEN) {
        /* Make room for the rest of the incomplete (small) frame. */
        memmove(self->buf, self->buf + pos, (size_t)(end - pos));
        self->start = 0;
        self->end = end - pos;
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(self);
    return result;
}

static PyObject *
FrameReader_stop(FrameReader *self, PyObject *Py_UNUSED(ignored))
{
    self->stopped = 1;
    Py_CLEAR(self->big); /* a large frame's memory goes now, not when we are collected */
    self->big_len = self->filled = 0;
    self->start = self->end = 0;
    /* and the callbacks, which lead back to the connection: no cycle is left */
    Py_CLEAR(self->emit);
    Py_CLEAR(self->fail);
    Py_RETURN_NONE;
}

static PyMethodDef FrameReader_methods[] = {
    {"stop", (PyCFunction)FrameReader_stop, METH_NOARGS,
     "stop(): the connection is gone: emit no more frames, and let go of the memory\n"
     "of a large frame being read and of the callbacks."},
    {"get_buffer", (PyCFunction)(void (*)(void))FrameReader_get_buffer, METH_FASTCALL,
     "get_buffer(sizehint=-1): where the next read goes (a writable memoryview)."},
    {"buffer_updated", (PyCFunction)FrameReader_buffer_updated, METH_O,
     "buffer_updated(nbytes): account nbytes read into get_buffer(); emit the frames\n"
     "they complete."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef FrameReader_members[] = {
    {"stopped", T_BOOL, offsetof(FrameReader, stopped), 0,
     "The connection is gone: emit no more frames."},
    {"__dictoffset__", T_PYSSIZET, offsetof(FrameReader, dict), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot FrameReader_slots[] = {
    {Py_tp_doc,
     "FrameReader(max_frame, emit, frame_memory, bad_stream, fail=None): one inbound\n"
     "stream connection's length-prefixed frames, each handed to emit(frame)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, FrameReader_init},
    {Py_tp_dealloc, FrameReader_dealloc},
    {Py_tp_traverse, FrameReader_traverse},
    {Py_tp_clear, FrameReader_clear},
    {Py_tp_methods, FrameReader_methods},
    {Py_tp_members, FrameReader_members},
    {Py_bf_getbuffer, FrameReader_getbuffer},
    {0, NULL},
};

static PyType_Spec FrameReader_spec = {
    .name = "amesh._ext.FrameReader",
    .basicsize = sizeof(FrameReader),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = FrameReader_slots,
};

/* ========================================================================== */
/* FrameWriter: one outbound stream connection's small frames, written in C    */
/* ========================================================================== */

/*
 * FrameWriter(small, batch_bytes)
 *
 * The write side of an outbound stream connection on asyncio (a protocol that
 * inherits it sets fd, transport, call_soon and end_turn once connected). send(frame)
 * takes a frame of up to small bytes (a bytes object) and puts its 4-byte length in
 * front:
 *
 * - written at once, with one writev(), when this process took in messages since
 *   this connection's last frame written at once (a FrameReader's read, a Receiver's
 *   drain: a reply to what came in, a call after a reply), so that the peer can
 *   start on it;
 * - else copied into a batch, which goes in one write() at the end of the loop's
 *   turn: the first frame batched has call_soon(end_turn) called, and end_turn
 *   calls finish_turn(). A batch of batch_bytes or more goes at once.
 *
 * What the kernel does not take goes to transport.write() (so also everything while
 * the transport still buffers). send() returns 0 and does nothing for a frame it does
 * not take: not bytes, larger than small, or the connection paused, gone or closing
 * (transport.is_closing()); the caller then writes it its own way, after flush().
 * It returns 1 once the frame is written or batched, and -1 when the connection
 * broke meanwhile (the transport is aborted; what was batched is lost with it).
 *
 * paused (settable): the transport asked us to stop writing (pause_writing).
 * batching (settable): False writes every frame at once.
 */

static PyObject *s_is_closing, *s_get_write_buffer_size, *s_write, *s_abort;

typedef struct {
    PyObject_HEAD
    int fd;                  /* the socket's; -1: none */
    PyObject *transport, *call_soon, *end_turn;
    char paused, batching, scheduled;
    unsigned long long turn; /* intakes at this connection's last frame written at once */
    Py_ssize_t small, batch_max;
    char *batch;             /* batch_max + small + FR_HLEN bytes, once needed */
    Py_ssize_t batch_len;
    PyObject *dict;
} FrameWriter;

static int
FrameWriter_init(FrameWriter *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"small", "batch_bytes", NULL};
    Py_ssize_t small, batch_max;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nn:FrameWriter", kwlist, &small, &batch_max)) {
        return -1;
    }
    if (small < 0 || batch_max < 0 || small > PY_SSIZE_T_MAX / 4 ||
        batch_max > PY_SSIZE_T_MAX / 4 || (uint64_t)small > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "small and batch_bytes must be sizes");
        return -1;
    }
    if (self->batch != NULL && (small != self->small || batch_max != self->batch_max)) {
        PyMem_Free(self->batch);
        self->batch = NULL;
    }
    self->fd = -1;
    self->small = small;
    self->batch_max = batch_max;
    self->batch_len = 0;
    self->paused = self->scheduled = 0;
    self->batching = 1;
    self->turn = intakes - 1;
    if (self->transport == NULL) {
        self->transport = Py_NewRef(Py_None);
    }
    return 0;
}

static int
FrameWriter_traverse(FrameWriter *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->transport);
    Py_VISIT(self->call_soon);
    Py_VISIT(self->end_turn);
    Py_VISIT(self->dict);
    return 0;
}

static int
FrameWriter_clear(FrameWriter *self)
{
    Py_CLEAR(self->transport);
    Py_CLEAR(self->call_soon);
    Py_CLEAR(self->end_turn);
    Py_CLEAR(self->dict);
    return 0;
}

static void
FrameWriter_dealloc(FrameWriter *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    FrameWriter_clear(self);
    PyMem_Free(self->batch);
    self->batch = NULL;
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* transport.<name>() as a C integer (is_closing: 0 or 1), at least 0; -1 with an
 * exception. */
static Py_ssize_t
fw_ask(FrameWriter *self, PyObject *name)
{
    if (self->transport == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FrameWriter: no transport");
        return -1;
    }
    PyObject *tr = Py_NewRef(self->transport);
    PyObject *r = PyObject_CallMethodNoArgs(tr, name);
    Py_DECREF(tr);
    if (r == NULL) {
        return -1;
    }
    Py_ssize_t v;
    if (PyBool_Check(r)) {
        v = r == Py_True;
    } else {
        v = PyLong_AsSsize_t(r);
        if (v < 0 && !PyErr_Occurred()) {
            v = 0;
        }
    }
    Py_DECREF(r);
    return v;
}

/* Whether the connection can take a frame: 1 yes, 0 no, -1 an exception. */
static int
fw_open(FrameWriter *self)
{
    if (self->fd < 0 || self->transport == NULL || self->transport == Py_None) {
        return 0;
    }
    Py_ssize_t closing = fw_ask(self, s_is_closing);
    return closing < 0 ? -1 : !closing;
}

/* transport.<method>() or transport.<method>(arg); -1 with an exception. */
static int
fw_call(FrameWriter *self, PyObject *method, PyObject *arg)
{
    if (self->transport == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FrameWriter: no transport");
        return -1;
    }
    PyObject *tr = Py_NewRef(self->transport);
    PyObject *r = arg == NULL ? PyObject_CallMethodNoArgs(tr, method)
                              : PyObject_CallMethodOneArg(tr, method, arg);
    Py_DECREF(tr);
    if (r == NULL) {
        return -1;
    }
    Py_DECREF(r);
    return 0;
}

/* Write the iovecs (a whole number of frames, total bytes): into the socket as far
 * as it takes them, the rest (or everything, while the transport buffers) to
 * transport.write(). 1 written, 0 the connection broke (the transport is aborted),
 * -1 an exception. */
static int
fw_writev(FrameWriter *self, struct iovec *iov, int n, Py_ssize_t total)
{
    Py_ssize_t buffered = fw_ask(self, s_get_write_buffer_size);
    if (buffered < 0) {
        return -1;
    }
    ssize_t done = 0;
    if (buffered == 0) {
        done = writev(self->fd, iov, n);
        if (done < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                return fw_call(self, s_abort, NULL) < 0 ? -1 : 0;
            }
            done = 0;
        }
        if (done == total) {
            return 1;
        }
    }
    PyObject *rest = PyBytes_FromStringAndSize(NULL, total - done);
    if (rest == NULL) {
        return -1;
    }
    char *p = PyBytes_AS_STRING(rest);
    Py_ssize_t skip = done;
    for (int i = 0; i < n; i++) {
        Py_ssize_t len = (Py_ssize_t)iov[i].iov_len;
        if (skip >= len) {
            skip -= len;
            continue;
        }
        memcpy(p, (char *)iov[i].iov_base + skip, (size_t)(len - skip));
        p += len - skip;
        skip = 0;
    }
    int rc = fw_call(self, s_write, rest);
    Py_DECREF(rest);
    return rc < 0 ? -1 : 1;
}

/* Send what is batched: 1 done (or nothing waited), 0 the connection broke or is
 * gone (what waited is lost), -1 an exception. */
static int
fw_flush(FrameWriter *self)
{
    if (self->batch_len == 0) {
        return 1;
    }
    /* The batch is ours while we write it (the transport's methods are Python: a
     * send() they led to would start a batch of its own, to go after this one). */
    char *batch = self->batch;
    Py_ssize_t len = self->batch_len;
    self->batch = NULL;
    self->batch_len = 0;
    int rc = fw_open(self); /* closed meanwhile: its fd may be reused, write nothing */
    if (rc > 0) {
        struct iovec iov = {batch, (size_t)len};
        rc = fw_writev(self, &iov, 1, len);
    }
    if (self->batch == NULL && self->fd >= 0) {
        self->batch = batch;
    } else { /* a new batch was started meanwhile, or the writer was dropped */
        PyMem_Free(batch);
    }
    return rc;
}

static PyObject *
FrameWriter_send(FrameWriter *self, PyObject *frame)
{
    if (!PyBytes_CheckExact(frame) || self->paused) {
        return PyLong_FromLong(0);
    }
    Py_ssize_t size = PyBytes_GET_SIZE(frame);
    if (size > self->small) {
        return PyLong_FromLong(0);
    }
    int open = fw_open(self);
    if (open <= 0) {
        return open < 0 ? NULL : PyLong_FromLong(0);
    }
    unsigned char head[FR_HLEN] = {(unsigned char)size, (unsigned char)(size >> 8),
                                   (unsigned char)(size >> 16), (unsigned char)(size >> 24)};
    if (self->scheduled || (self->batching && self->turn == intakes)) {
        if (self->batch == NULL) {
            self->batch = PyMem_Malloc((size_t)(self->batch_max + self->small + FR_HLEN));
            if (self->batch == NULL) {
                return PyErr_NoMemory();
            }
        }
        if (!self->scheduled) {
            if (self->call_soon == NULL || self->end_turn == NULL) {
                PyErr_SetString(PyExc_RuntimeError, "FrameWriter: call_soon and end_turn not set");
                return NULL;
            }
            PyObject *h = PyObject_CallOneArg(self->call_soon, self->end_turn);
            if (h == NULL) {
                return NULL;
            }
            Py_DECREF(h);
            self->scheduled = 1;
        }
        memcpy(self->batch + self->batch_len, head, FR_HLEN);
        memcpy(self->batch + self->batch_len + FR_HLEN, PyBytes_AS_STRING(frame), (size_t)size);
        self->batch_len += FR_HLEN + size;
        if (self->batch_len >= self->batch_max) {
            int rc = fw_flush(self);
            if (rc <= 0) {
                return rc < 0 ? NULL : PyLong_FromLong(-1);
            }
        }
        return PyLong_FromLong(1);
    }
    self->turn = intakes;
    struct iovec iov[2] = {{head, FR_HLEN}, {PyBytes_AS_STRING(frame), (size_t)size}};
    int rc = fw_writev(self, iov, 2, FR_HLEN + size);
    return rc < 0 ? NULL : PyLong_FromLong(rc ? 1 : -1);
}

static PyObject *
FrameWriter_flush(FrameWriter *self, PyObject *Py_UNUSED(ignored))
{
    int rc = fw_flush(self);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyObject *
FrameWriter_finish_turn(FrameWriter *self, PyObject *Py_UNUSED(ignored))
{
    self->scheduled = 0;
    int rc = fw_flush(self);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyObject *
FrameWriter_drop(FrameWriter *self, PyObject *Py_UNUSED(ignored))
{
    self->batch_len = 0;
    if (self->batch != NULL) {
        PyMem_Free(self->batch);
        self->batch = NULL;
    }
    self->fd = -1;
    self->scheduled = 0;
    Py_CLEAR(self->call_soon);
    Py_CLEAR(self->end_turn); /* (a bound method of ours: a cycle) */
    Py_XSETREF(self->transport, Py_NewRef(Py_None));
    Py_RETURN_NONE;
}

static PyObject *
FrameWriter_get_batched(FrameWriter *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->batch_len);
}

static PyMethodDef FrameWriter_methods[] = {
    {"send", (PyCFunction)FrameWriter_send, METH_O,
     "send(frame) -> 1 written or batched, 0 not taken (nothing done), -1 taken but\n"
     "the connection broke."},
    {"flush", (PyCFunction)FrameWriter_flush, METH_NOARGS,
     "flush() -> bool: write what is batched now; False if the connection broke or\n"
     "is gone (what waited is lost)."},
    {"finish_turn", (PyCFunction)FrameWriter_finish_turn, METH_NOARGS,
     "finish_turn() -> bool: the loop's turn is over (end_turn runs): flush()."},
    {"drop", (PyCFunction)FrameWriter_drop, METH_NOARGS,
     "drop(): the connection is gone: forget what is batched and let go of the\n"
     "batch's memory, the transport and the loop's hooks; send() takes nothing more."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef FrameWriter_getset[] = {
    {"batched", (getter)FrameWriter_get_batched, NULL, "Bytes batched, waiting.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef FrameWriter_members[] = {
    {"fd", T_INT, offsetof(FrameWriter, fd), 0, "The socket's file descriptor; -1: none."},
    {"transport", T_OBJECT, offsetof(FrameWriter, transport), 0,
     "The connection's asyncio transport (None: none)."},
    {"call_soon", T_OBJECT, offsetof(FrameWriter, call_soon), 0, "The loop's call_soon."},
    {"end_turn", T_OBJECT, offsetof(FrameWriter, end_turn), 0,
     "Called by the loop at the end of a turn with a batch: it calls finish_turn()."},
    {"paused", T_BOOL, offsetof(FrameWriter, paused), 0, "The transport paused writing."},
    {"batching", T_BOOL, offsetof(FrameWriter, batching), 0,
     "Whether frames may wait for the end of the turn."},
    {"__dictoffset__", T_PYSSIZET, offsetof(FrameWriter, dict), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot FrameWriter_slots[] = {
    {Py_tp_doc,
     "FrameWriter(small, batch_bytes): the write side of an outbound stream\n"
     "connection, for frames of up to small bytes."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, FrameWriter_init},
    {Py_tp_dealloc, FrameWriter_dealloc},
    {Py_tp_traverse, FrameWriter_traverse},
    {Py_tp_clear, FrameWriter_clear},
    {Py_tp_methods, FrameWriter_methods},
    {Py_tp_members, FrameWriter_members},
    {Py_tp_getset, FrameWriter_getset},
    {0, NULL},
};

static PyType_Spec FrameWriter_spec = {
    .name = "amesh._ext.FrameWriter",
    .basicsize = sizeof(FrameWriter),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = FrameWriter_slots,
};

/* ========================================================================== */
/* EnvelopeDecoder: a received frame's envelope and buffers, in one C call     */
/* ========================================================================== */

/*
 * EnvelopeDecoder(preamble, decode, checks)
 *
 * Called with a frame (any buffer: a bytes from a FrameReader, an NNG Message), it
 * does what amesh._wire.decode does with a well-formed frame: it checks the
 * preamble (the magic bytes and the protocol version; a little-endian u32 with the
 * envelope's length follows), decodes the envelope with decode(view) (msgspec's
 * Decoder.decode), runs checks.get(type(env)) on it when there is one (a check
 * returns "" or what is wrong), and cuts the out-of-band buffers that the envelope's
 * ``buffers`` field lists out of the frame, as memoryviews of it. It returns
 * (env, buffers).
 *
 * For anything else it returns None: too short, another preamble or version, a
 * truncated envelope or buffer, stray bytes, a decode error, a failed check. The
 * caller then decodes the frame again in Python, which says what is wrong. So no
 * policy lives here, and only a malformed frame is decoded twice.
 *
 * decode() reads a view of the frame's memory that is released before the call
 * returns: it must not keep it (msgspec copies every str and bytes out of its
 * input; if anything still holds the view, the call raises RuntimeError).
 */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fn;     /* msgspec's Decoder.decode or Encoder.encode */
    PyObject *checks; /* a decoder's: type -> check(env); NULL in an encoder */
    char preamble[16];
    Py_ssize_t preamble_len;
} Codec;

typedef Codec EnvelopeDecoder;
typedef Codec EnvelopeEncoder;

static PyObject *s_buffers, *s_release;

static int
Codec_traverse(Codec *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->fn);
    Py_VISIT(self->checks);
    return 0;
}

static int
Codec_clear(Codec *self)
{
    Py_CLEAR(self->fn);
    Py_CLEAR(self->checks);
    return 0;
}

static void
Codec_dealloc(Codec *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Codec_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* A new codec of type (checks NULL for an encoder); the preamble is 1 to 16 bytes. */
static PyObject *
Codec_make(PyTypeObject *type, Py_buffer *pre, PyObject *fn, PyObject *checks,
           vectorcallfunc call)
{
    Codec *self = NULL;
    if (pre->len < 1 || pre->len > (Py_ssize_t)sizeof(self->preamble)) {
        PyErr_SetString(PyExc_ValueError, "the preamble is 1 to 16 bytes");
    }
    else if ((self = (Codec *)type->tp_alloc(type, 0)) != NULL) {
        memcpy(self->preamble, pre->buf, pre->len);
        self->preamble_len = pre->len;
        self->fn = Py_NewRef(fn);
        self->checks = Py_XNewRef(checks);
        self->vectorcall = call;
    }
    PyBuffer_Release(pre);
    return (PyObject *)self;
}

static PyMemberDef Codec_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Codec, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

/* The slots and spec of codec type NAME, made by NAME_new. */
#define CODEC_TYPE(NAME, DOC)                                                          \
    static PyType_Slot NAME##_slots[] = {                                              \
        {Py_tp_doc, DOC},                                                              \
        {Py_tp_new, NAME##_new},                                                       \
        {Py_tp_call, PyVectorcall_Call},                                               \
        {Py_tp_dealloc, Codec_dealloc},                                                \
        {Py_tp_traverse, Codec_traverse},                                              \
        {Py_tp_clear, Codec_clear},                                                    \
        {Py_tp_members, Codec_members},                                                \
        {0, NULL},                                                                     \
    };                                                                                 \
    static PyType_Spec NAME##_spec = {                                                 \
        .name = "amesh._ext." #NAME,                                                   \
        .basicsize = sizeof(Codec),                                                    \
        .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL, \
        .slots = NAME##_slots,                                                         \
    }

/* The envelope of the frame at p (n bytes), or NULL with no error set when it is
 * not a well-formed one (or with the error set when something else went wrong). */
static PyObject *
decode_envelope(EnvelopeDecoder *self, const char *p, Py_ssize_t n, Py_ssize_t *end)
{
    Py_ssize_t head = self->preamble_len + 4;
    if (n < head || memcmp(p, self->preamble, self->preamble_len) != 0) {
        return NULL;
    }
    const unsigned char *q = (const unsigned char *)p + self->preamble_len;
    uint32_t length = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 |
                      (uint32_t)q[3] << 24;
    if ((Py_ssize_t)length > n - head) {
        return NULL;
    }
    *end = head + (Py_ssize_t)length;
    PyObject *view = PyMemoryView_FromMemory((char *)p + head, (Py_ssize_t)length, PyBUF_READ);
    if (view == NULL) {
        return NULL;
    }
    PyObject *env = PyObject_CallOneArg(self->fn, view);
    if (env == NULL) {
        PyErr_Clear(); /* malformed: the Python decoder says how */
    }
    if (Py_REFCNT(view) > 1) {
        /* decode kept the view: end it before the frame can go */
        PyObject *r = PyObject_CallMethodNoArgs(view, s_release);
        Py_XDECREF(r);
        Py_DECREF(view);
        Py_XDECREF(env);
        if (r != NULL) {
            PyErr_SetString(PyExc_RuntimeError, "the envelope decoder kept the frame's memory");
        }
        return NULL;
    }
    Py_DECREF(view);
    if (env == NULL) {
        return NULL;
    }
    PyObject *check = PyDict_GetItemWithError(self->checks, (PyObject *)Py_TYPE(env));
    if (check != NULL) {
        Py_INCREF(check); /* (borrowed from a dict that the check could change) */
        PyObject *why = PyObject_CallOneArg(check, env);
        Py_DECREF(check);
        int bad = why == NULL ? -1 : PyObject_IsTrue(why);
        Py_XDECREF(why);
        if (bad != 0) {
            PyErr_Clear();
            Py_DECREF(env);
            return NULL;
        }
    }
    else if (PyErr_Occurred()) {
        Py_DECREF(env);
        return NULL;
    }
    return env;
}

/* [memoryview of frame[pos:pos + n] for n in lengths], or NULL (no error set) when
 * they do not fill the frame from pos exactly. */
static PyObject *
cut_buffers(PyObject *frame, PyObject *lengths, Py_ssize_t pos, Py_ssize_t size)
{
    Py_ssize_t count = PyList_GET_SIZE(lengths);
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        return NULL;
    }
    PyObject *whole = PyMemoryView_FromObject(frame);
    if (whole == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t len = PyLong_AsSsize_t(PyList_GET_ITEM(lengths, i));
        if (len < 0 || len > size - pos) {
            PyErr_Clear();
            goto bad;
        }
        PyObject *lo = PyLong_FromSsize_t(pos), *hi = PyLong_FromSsize_t(pos + len);
        PyObject *slice = lo != NULL && hi != NULL ? PySlice_New(lo, hi, NULL) : NULL;
        Py_XDECREF(lo);
        Py_XDECREF(hi);
        PyObject *part = slice != NULL ? PyObject_GetItem(whole, slice) : NULL;
        Py_XDECREF(slice);
        if (part == NULL) {
            goto bad;
        }
        PyList_SET_ITEM(out, i, part);
        pos += len;
    }
    Py_DECREF(whole);
    if (pos != size) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
bad:
    Py_DECREF(whole);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
EnvelopeDecoder_vectorcall(EnvelopeDecoder *self, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "EnvelopeDecoder takes one frame");
        return NULL;
    }
    PyObject *frame = args[0];
    Py_buffer buf;
    const char *p;
    Py_ssize_t n, end = 0;
    int held = 0;
    if (PyBytes_CheckExact(frame)) {
        p = PyBytes_AS_STRING(frame);
        n = PyBytes_GET_SIZE(frame);
    }
    else {
        if (PyObject_GetBuffer(frame, &buf, PyBUF_SIMPLE) < 0) {
            return NULL;
        }
        held = 1;
        p = buf.buf;
        n = buf.len;
    }
    PyObject *result = NULL, *buffers = NULL, *lengths = NULL;
    PyObject *env = decode_envelope(self, p, n, &end);
    if (env == NULL) {
        goto done;
    }
    lengths = PyObject_GetAttr(env, s_buffers);
    if (lengths == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) {
            goto done;
        }
        PyErr_Clear();
    }
    if (lengths == NULL || (PyList_CheckExact(lengths) && PyList_GET_SIZE(lengths) == 0)) {
        buffers = end == n ? PyList_New(0) : NULL;
    }
    else if (PyList_CheckExact(lengths)) {
        buffers = cut_buffers(frame, lengths, end, n);
    }
    if (buffers != NULL) {
        result = PyTuple_Pack(2, env, buffers);
    }
done:
    Py_XDECREF(env);
    Py_XDECREF(lengths);
    Py_XDECREF(buffers);
    if (held) {
        PyBuffer_Release(&buf);
    }
    if (result == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE;
    }
    return result;
}

static PyObject *
EnvelopeDecoder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"preamble", "decode", "checks", NULL};
    Py_buffer pre;
    PyObject *decode, *checks;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*OO!:EnvelopeDecoder", kwlist, &pre, &decode,
                                     &PyDict_Type, &checks)) {
        return NULL;
    }
    return Codec_make(type, &pre, decode, checks, (vectorcallfunc)EnvelopeDecoder_vectorcall);
}

CODEC_TYPE(EnvelopeDecoder,
           "EnvelopeDecoder(preamble, decode, checks): called with a frame, (envelope,\n"
           "buffers) if it is well-formed, else None.");

/*
 * EnvelopeEncoder(preamble, encode)
 *
 * Called with an envelope, it returns the frame of that envelope with no
 * out-of-band buffers, as amesh._wire.encode makes it: the preamble, the length of
 * the encoded envelope as a little-endian u32, then encode(env) (msgspec's
 * Encoder.encode). Errors from encode propagate.
 */

static PyObject *
EnvelopeEncoder_vectorcall(EnvelopeEncoder *self, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "EnvelopeEncoder takes one envelope");
        return NULL;
    }
    PyObject *body = PyObject_CallOneArg(self->fn, args[0]);
    if (body == NULL) {
        return NULL;
    }
    if (!PyBytes_CheckExact(body)) {
        Py_DECREF(body);
        PyErr_SetString(PyExc_TypeError, "encode() did not return bytes");
        return NULL;
    }
    Py_ssize_t len = PyBytes_GET_SIZE(body), head = self->preamble_len + 4;
    if ((uint64_t)len > UINT32_MAX) {
        Py_DECREF(body);
        PyErr_SetString(PyExc_ValueError, "the envelope is longer than a frame can say");
        return NULL;
    }
    PyObject *frame = PyBytes_FromStringAndSize(NULL, head + len);
    if (frame != NULL) {
        unsigned char *p = (unsigned char *)PyBytes_AS_STRING(frame);
        memcpy(p, self->preamble, self->preamble_len);
        p += self->preamble_len;
        p[0] = (unsigned char)len;
        p[1] = (unsigned char)(len >> 8);
        p[2] = (unsigned char)(len >> 16);
        p[3] = (unsigned char)(len >> 24);
        memcpy(p + 4, PyBytes_AS_STRING(body), len);
    }
    Py_DECREF(body);
    return frame;
}

static PyObject *
EnvelopeEncoder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"preamble", "encode", NULL};
    Py_buffer pre;
    PyObject *encode;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*O:EnvelopeEncoder", kwlist, &pre, &encode)) {
        return NULL;
    }
    return Codec_make(type, &pre, encode, NULL, (vectorcallfunc)EnvelopeEncoder_vectorcall);
}

CODEC_TYPE(EnvelopeEncoder,
           "EnvelopeEncoder(preamble, encode): called with an envelope, its frame (no\n"
           "out-of-band buffers).");

/* ========================================================================== */
/* Large received bytes: refilled rather than fresh pages                      */
/* ========================================================================== */

/*
 * pread_bytes(fd, size, spare) -> (data, reused)
 *
 * The first size bytes of the file fd as a bytes object. Where the list spare
 * holds a bytes object of exactly size bytes whose only reference is the list's,
 * that object is filled again and returned (reused is True): its pages are in
 * memory already, while a new object of many megabytes gets fresh pages, which the
 * kernel faults in and zeroes one by one as the read fills them (three times the
 * cost of the copy itself, measured). Nobody can see the change: no one else holds
 * the object, and its cached hash is reset. Else a new object (reused False). Which
 * objects go into spare, and for how long, is the caller's.
 *
 * Raises OSError on a read error, RuntimeError when the file is shorter than size.
 */
/* A bytes object of size bytes to fill (a new reference; NULL with an exception):
 * one in the list spare that nothing but the list references, its cached hash reset
 * (*reused = 1), else a new one (*reused = 0). */
static PyObject *
bytes_to_fill(PyObject *spare, Py_ssize_t size, int *reused)
{
    *reused = 0;
#ifndef Py_GIL_DISABLED /* without the GIL a reference count of 1 proves nothing */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(spare); i++) {
        PyObject *item = PyList_GET_ITEM(spare, i);
        if (PyBytes_CheckExact(item) && PyBytes_GET_SIZE(item) == size && Py_REFCNT(item) == 1) {
            _Py_COMP_DIAG_PUSH
            _Py_COMP_DIAG_IGNORE_DEPR_DECLS
            ((PyBytesObject *)item)->ob_shash = -1;
            _Py_COMP_DIAG_POP
            *reused = 1;
            return Py_NewRef(item); /* from now on nobody else can take it either */
        }
    }
#endif
    return PyBytes_FromStringAndSize(NULL, size);
}

static PyObject *
ext_pread_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "pread_bytes(fd, size, spare: list)");
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    if ((fd == -1 || size == -1) && PyErr_Occurred()) {
        return NULL;
    }
    if (fd < 0 || fd > INT_MAX || size < 0) {
        PyErr_Format(PyExc_ValueError, "bad fd %ld or size %zd", fd, size);
        return NULL;
    }
    int reused;
    PyObject *data = bytes_to_fill(args[2], size, &reused);
    if (data == NULL) {
        return NULL;
    }
    char *buf = PyBytes_AS_STRING(data);
    Py_ssize_t done = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (done < size) {
        ssize_t n = pread((int)fd, buf + done, (size_t)(size - done), (off_t)done);
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            err = errno;
            break;
        }
        if (n == 0) {
            break;
        }
        done += n;
    }
    Py_END_ALLOW_THREADS
    if (err) {
        Py_DECREF(data);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (done < size) {
        Py_DECREF(data);
        PyErr_Format(PyExc_RuntimeError, "the file holds %zd bytes, not %zd", done, size);
        return NULL;
    }
    return Py_BuildValue("(NO)", data, reused ? Py_True : Py_False);
}

/*
 * copy_bytes(buffer, size, spare) -> (data, reused)
 *
 * pread_bytes() out of a buffer (a mapping of the file) instead of a file: the
 * first size bytes of buffer, in an object of spare if one is free, copied with the
 * GIL released (the buffer is held meanwhile).
 */
static PyObject *
ext_copy_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "copy_bytes(buffer, size, spare: list)");
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    if (size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (size < 0 || size > view.len) {
        PyErr_Format(PyExc_ValueError, "cannot copy %zd bytes out of a buffer of %zd", size,
                     view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    int reused;
    PyObject *data = bytes_to_fill(args[2], size, &reused);
    if (data == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(data);
    Py_BEGIN_ALLOW_THREADS
    memcpy(dst, view.buf, (size_t)size);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(NO)", data, reused ? Py_True : Py_False);
}

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

static PyMethodDef ext_methods[] = {
    {"bind", (PyCFunction)ext_bind, METH_O,
     "bind(functions): the addresses of NNG_FUNCTIONS in the loaded NNG."},
    {"send", (PyCFunction)(void (*)(void))ext_send, METH_FASTCALL,
     "send(socket, data): hand a copy of data (a buffer, or an iterable of\n"
     "buffers joined back to back) to NNG without waiting; False if full."},
    {"cut_frames", (PyCFunction)(void (*)(void))ext_cut_frames, METH_FASTCALL,
     "cut_frames(buffer, start, end, limit) -> (frames, pos, size): the whole\n"
     "length-prefixed frames of buffer[start:end] as bytes, where the rest starts,\n"
     "and the length the next frame announces (-1: fewer than 4 bytes left)."},
    {"pread_bytes", (PyCFunction)(void (*)(void))ext_pread_bytes, METH_FASTCALL,
     "pread_bytes(fd, size, spare) -> (data, reused): the first size bytes of file fd\n"
     "as bytes, refilling a bytes object of that size in the list spare that nothing\n"
     "else references (reused True), else a new one."},
    {"copy_bytes", (PyCFunction)(void (*)(void))ext_copy_bytes, METH_FASTCALL,
     "copy_bytes(buffer, size, spare) -> (data, reused): pread_bytes() out of a\n"
     "buffer: its first size bytes, in an object of spare nothing else references."},
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
    {"finalize", (PyCFunction)ext_finalize, METH_NOARGS,
     "Stop every Receiver and NNG Beat, and make no more NNG calls (run at exit, before the sockets close)."},
    {"_wait_uninterruptibly", (PyCFunction)ext_wait_uninterruptibly, METH_O,
     "_wait_uninterruptibly(seconds): for tests, sleep in the kernel in state D."},
    {NULL, NULL, 0, NULL},
};

/* ========================================================================== */
/* Module definition                                                           */
/* ========================================================================== */

static int
ext_exec(PyObject *module)
{
    ext_state *st = get_state(module);

    if (PyModule_AddObjectRef(module, "CAN_IMMORTALIZE",
                              AMESH_CAN_IMMORTALIZE ? Py_True : Py_False) < 0) {
        return -1;
    }
    st->NngError = PyErr_NewExceptionWithDoc(
        "amesh._ext.NngError", "An NNG error: args are (errno, strerror).", PyExc_OSError, NULL);
    if (st->NngError == NULL || PyModule_AddObjectRef(module, "NngError", st->NngError) < 0) {
        return -1;
    }
    st->MessageType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Message_spec, NULL);
    if (st->MessageType == NULL ||
        PyModule_AddType(module, st->MessageType) < 0) {
        return -1;
    }
    st->ReceiverType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Receiver_spec, NULL);
    if (st->ReceiverType == NULL ||
        PyModule_AddType(module, st->ReceiverType) < 0) {
        return -1;
    }
    st->BeatType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Beat_spec, NULL);
    if (st->BeatType == NULL || PyModule_AddType(module, st->BeatType) < 0) {
        return -1;
    }
    st->FrameReaderType =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &FrameReader_spec, NULL);
    if (st->FrameReaderType == NULL || PyModule_AddType(module, st->FrameReaderType) < 0) {
        return -1;
    }
    st->FrameWriterType =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &FrameWriter_spec, NULL);
    if (st->FrameWriterType == NULL || PyModule_AddType(module, st->FrameWriterType) < 0) {
        return -1;
    }
    st->EnvelopeDecoderType =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &EnvelopeDecoder_spec, NULL);
    if (st->EnvelopeDecoderType == NULL ||
        PyModule_AddType(module, st->EnvelopeDecoderType) < 0) {
        return -1;
    }
    st->EnvelopeEncoderType =
        (PyTypeObject *)PyType_FromModuleAndSpec(module, &EnvelopeEncoder_spec, NULL);
    if (st->EnvelopeEncoderType == NULL ||
        PyModule_AddType(module, st->EnvelopeEncoderType) < 0) {
        return -1;
    }
    if (s_buffers == NULL) {
        s_buffers = PyUnicode_InternFromString("buffers");
        s_release = PyUnicode_InternFromString("release");
        if (s_buffers == NULL || s_release == NULL) {
            return -1;
        }
    }
    if (s_is_closing == NULL) {
        s_is_closing = PyUnicode_InternFromString("is_closing");
        s_get_write_buffer_size = PyUnicode_InternFromString("get_write_buffer_size");
        s_write = PyUnicode_InternFromString("write");
        s_abort = PyUnicode_InternFromString("abort");
        if (s_is_closing == NULL || s_get_write_buffer_size == NULL || s_write == NULL ||
            s_abort == NULL) {
            return -1;
        }
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

static int
ext_traverse(PyObject *module, visitproc visit, void *arg)
{
    ext_state *st = get_state(module);
    Py_VISIT(st->NngError);
    Py_VISIT(st->MessageType);
    Py_VISIT(st->ReceiverType);
    Py_VISIT(st->BeatType);
    Py_VISIT(st->FrameReaderType);
    Py_VISIT(st->FrameWriterType);
    Py_VISIT(st->EnvelopeDecoderType);
    Py_VISIT(st->EnvelopeEncoderType);
    return 0;
}

static int
ext_clear(PyObject *module)
{
    ext_state *st = get_state(module);
    Py_CLEAR(st->NngError);
    Py_CLEAR(st->MessageType);
    Py_CLEAR(st->ReceiverType);
    Py_CLEAR(st->BeatType);
    Py_CLEAR(st->FrameReaderType);
    Py_CLEAR(st->FrameWriterType);
    Py_CLEAR(st->EnvelopeDecoderType);
    Py_CLEAR(st->EnvelopeEncoderType);
    return 0;
}

static void
ext_free(void *module)
{
    ext_clear((PyObject *)module);
}

static PyModuleDef_Slot ext_slots[] = {
    {Py_mod_exec, ext_exec},
    {0, NULL},
};

static struct PyModuleDef ext_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "amesh._ext",
    .m_doc = "Receive completion queue and non-blocking sends over pynng's NNG; "
             "heartbeats from a thread without the GIL.",
    .m_size = sizeof(ext_state),
    .m_methods = ext_methods,
    .m_slots = ext_slots,
    .m_traverse = ext_traverse,
    .m_clear = ext_clear,
    .m_free = ext_free,
};

PyMODINIT_FUNC
PyInit__ext(void)
{
    return PyModuleDef_Init(&ext_module);
}
