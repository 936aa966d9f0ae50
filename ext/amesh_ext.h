/*
 * What the files of amesh._native._ext share: the NNG declarations, the module state, and
 * the few functions and counters one concern's file uses from another's. Private to
 * ext/: every name declared here is AMESH_INTERNAL, so that the module exports only
 * PyInit__ext and its files cannot clash with another library's symbols.
 */

#ifndef AMESH_EXT_H
#define AMESH_EXT_H

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

/* Shared between the files of this module, invisible outside it (the files are
 * built with the compiler's default visibility, which exports every extern name). */
#define AMESH_INTERNAL __attribute__((visibility("hidden")))

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

#define NNG_EAGAIN 8
#define NNG_ECLOSED 7

/* The NNG functions, by the addresses bind() was given (in the order of nng.c's
 * api_names). */
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

/* ========================================================================== */
/* Between the files                                                           */
/* ========================================================================== */

/* How many times this process took in messages: a FrameReader's reads and a
 * Receiver's drains (see FrameWriter.send). GIL held. */
AMESH_INTERNAL extern unsigned long long amesh_intakes;

/* A stream frame's header: its length as a little-endian u32. */
#define FR_HLEN 4

/* nng.c: raise NngError(rv, strerror) and return NULL; -1 with RuntimeError unless
 * bind() ran and finalize() did not. */
AMESH_INTERNAL PyObject *amesh_raise_nng(ext_state *st, int rv);
AMESH_INTERNAL int amesh_require_bound(ext_state *st);

/* beat.c: stop every Beat on an NNG socket and wait for its thread (finalize()). */
AMESH_INTERNAL void amesh_stop_nng_beats(ext_state *st);

/* Each concern adds its types, functions and constants to the module (0, or -1 with
 * an exception), in the module's exec slot (module.c). */
AMESH_INTERNAL int amesh_exec_nng(PyObject *module, ext_state *st);
AMESH_INTERNAL int amesh_exec_beat(PyObject *module, ext_state *st);
AMESH_INTERNAL int amesh_exec_frame_reader(PyObject *module, ext_state *st);
AMESH_INTERNAL int amesh_exec_frame_writer(PyObject *module, ext_state *st);
AMESH_INTERNAL int amesh_exec_envelope(PyObject *module, ext_state *st);
AMESH_INTERNAL int amesh_exec_bytes(PyObject *module, ext_state *st);
AMESH_INTERNAL int amesh_exec_process(PyObject *module, ext_state *st);

/* A type made from spec and added to the module (a new reference; NULL with an
 * exception): the exec functions' common step. */
AMESH_INTERNAL PyTypeObject *amesh_add_type(PyObject *module, PyType_Spec *spec);

#endif /* AMESH_EXT_H */
