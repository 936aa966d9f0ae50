/*
 * amesh._native._ext's stream reading (the default transport within a host): cut_frames(),
 * which the Python reader (amesh._transport._stream_framing) uses to cut the whole
 * frames out of what a read brought in one call, and FrameReader, that whole reader,
 * so that the event loop's read callbacks on a proven inbound connection run no
 * Python code until a frame is handed over.
 */

#include "amesh_ext.h"

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
 * What amesh._transport._stream_framing.Reader does, in C, so that the event loop's
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
    amesh_intakes++;
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
    .name = "amesh._native._ext.FrameReader",
    .basicsize = sizeof(FrameReader),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = FrameReader_slots,
};

static PyMethodDef frame_reader_functions[] = {
    {"cut_frames", (PyCFunction)(void (*)(void))ext_cut_frames, METH_FASTCALL,
     "cut_frames(buffer, start, end, limit) -> (frames, pos, size): the whole\n"
     "length-prefixed frames of buffer[start:end] as bytes, where the rest starts,\n"
     "and the length the next frame announces (-1: fewer than 4 bytes left)."},
    {NULL, NULL, 0, NULL},
};

int
amesh_exec_frame_reader(PyObject *module, ext_state *st)
{
    st->FrameReaderType = amesh_add_type(module, &FrameReader_spec);
    if (st->FrameReaderType == NULL) {
        return -1;
    }
    return PyModule_AddFunctions(module, frame_reader_functions);
}
