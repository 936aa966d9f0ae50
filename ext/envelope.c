/*
 * amesh._native._ext's envelope codec: EnvelopeDecoder and EnvelopeEncoder, a frame's
 * preamble, envelope (through msgspec), checks and out-of-band buffers in one call
 * each way, for every transport (amesh._wire.try_decode and encode_envelope); a frame
 * they do not take is left to the Python decoder, which says what is wrong with it.
 */

#include "amesh_ext.h"

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
        .name = "amesh._native._ext." #NAME,                                                   \
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

int
amesh_exec_envelope(PyObject *module, ext_state *st)
{
    if ((st->EnvelopeDecoderType = amesh_add_type(module, &EnvelopeDecoder_spec)) == NULL ||
        (st->EnvelopeEncoderType = amesh_add_type(module, &EnvelopeEncoder_spec)) == NULL) {
        return -1;
    }
    if (s_buffers == NULL) {
        s_buffers = PyUnicode_InternFromString("buffers");
        s_release = PyUnicode_InternFromString("release");
        if (s_buffers == NULL || s_release == NULL) {
            return -1;
        }
    }
    return 0;
}
