/*
 * amesh._native._ext's stream writing: FrameWriter, the write side of an outbound stream
 * connection on asyncio, for small frames: each written at once (one writev with its
 * length), or batched to the end of the loop's turn, with no Python code of ours in
 * between.
 */

#include "amesh_ext.h"

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
    self->turn = amesh_intakes - 1;
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
    if (self->scheduled || (self->batching && self->turn == amesh_intakes)) {
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
    self->turn = amesh_intakes;
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
    .name = "amesh._native._ext.FrameWriter",
    .basicsize = sizeof(FrameWriter),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = FrameWriter_slots,
};

int
amesh_exec_frame_writer(PyObject *module, ext_state *st)
{
    st->FrameWriterType = amesh_add_type(module, &FrameWriter_spec);
    if (st->FrameWriterType == NULL) {
        return -1;
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
    return 0;
}
