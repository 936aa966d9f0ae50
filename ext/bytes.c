/*
 * amesh._native._ext's large received bytes: pread_bytes() and copy_bytes() put a large bytes
 * payload read out of shared memory (amesh._wire) into a bytes object the process
 * already has and nobody references any more, rather than into fresh pages;
 * copy_bytes() copies out of a mapping the receiver keeps, with the GIL released.
 */

#include "amesh_ext.h"

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

static PyMethodDef bytes_functions[] = {
    {"pread_bytes", (PyCFunction)(void (*)(void))ext_pread_bytes, METH_FASTCALL,
     "pread_bytes(fd, size, spare) -> (data, reused): the first size bytes of file fd\n"
     "as bytes, refilling a bytes object of that size in the list spare that nothing\n"
     "else references (reused True), else a new one."},
    {"copy_bytes", (PyCFunction)(void (*)(void))ext_copy_bytes, METH_FASTCALL,
     "copy_bytes(buffer, size, spare) -> (data, reused): pread_bytes() out of a\n"
     "buffer: its first size bytes, in an object of spare nothing else references."},
    {NULL, NULL, 0, NULL},
};

int
amesh_exec_bytes(PyObject *module, ext_state *st)
{
    return PyModule_AddFunctions(module, bytes_functions);
}
