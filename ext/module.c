/*
 * amesh._native._ext: amesh's C extension, one module built from a file per concern.
 *
 * - nng.c: a thin companion to pynng for amesh's NNG transport (Receiver, Message,
 *   send(), bind(), finalize()), driving the NNG that pynng loaded through function
 *   addresses handed over at import: the module links against nothing.
 * - beat.c: Beat, heartbeats written by a thread that never takes the GIL.
 * - frame_reader.c, frame_writer.c: the stream transport's framing (cut_frames(),
 *   FrameReader, FrameWriter), so that the event loop's callbacks run no Python code
 *   of ours between a read or a write and a whole frame.
 * - envelope.c: EnvelopeDecoder and EnvelopeEncoder, a frame to its envelope and
 *   buffers and back in one call, for every transport.
 * - bytes.c: pread_bytes(), copy_bytes(), large bytes read out of shared memory into
 *   objects the process already has.
 * - process.c: a worker's and its zygote's system calls without ctypes
 *   (exit_when_closed(), set_parent_death_signal(), C's stdio, immortalize()).
 * - amesh_ext.h: what they share (the NNG declarations, the module state).
 *
 * Policy (batch sizes, ring capacity, what an error means, when to wait) is the
 * caller's: amesh._transport and amesh._wire.
 */

#include "amesh_ext.h"

unsigned long long amesh_intakes;

PyTypeObject *
amesh_add_type(PyObject *module, PyType_Spec *spec)
{
    PyObject *type = PyType_FromModuleAndSpec(module, spec, NULL);
    if (type != NULL && PyModule_AddType(module, (PyTypeObject *)type) < 0) {
        Py_CLEAR(type);
    }
    return (PyTypeObject *)type;
}

static int
ext_exec(PyObject *module)
{
    ext_state *st = get_state(module);
    if (amesh_exec_process(module, st) < 0 || amesh_exec_nng(module, st) < 0 ||
        amesh_exec_beat(module, st) < 0 || amesh_exec_frame_reader(module, st) < 0 ||
        amesh_exec_frame_writer(module, st) < 0 || amesh_exec_envelope(module, st) < 0 ||
        amesh_exec_bytes(module, st) < 0) {
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

/* Each file adds its own functions (amesh_exec_*), next to their code. */
static struct PyModuleDef ext_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "amesh._native._ext",
    .m_doc = "Receive completion queue and non-blocking sends over pynng's NNG; "
             "heartbeats from a thread without the GIL.",
    .m_size = sizeof(ext_state),
    .m_methods = NULL,
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
