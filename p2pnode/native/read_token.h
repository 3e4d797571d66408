/* read_token: one token id from a Python object, as uint32, and its bytes (shared by p2pnode's C extensions).
 *
 * A token outside [0, 2**32) raises ValueError, a non-integer TypeError (the errors of p2pnode's Python paths);
 * an integer of a static C type (numpy's) is read through its __index__; a Python class's is refused (its
 * __index__ could change the list being read in place).
 */
#ifndef P2PNODE_READ_TOKEN_H
#define P2PNODE_READ_TOKEN_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* A token id as the block hash reads it: 4 little-endian bytes, whatever the host's byte order. */
static inline void
store_le32(unsigned char *dst, uint32_t v)
{
    dst[0] = (unsigned char)v;
    dst[1] = (unsigned char)(v >> 8);
    dst[2] = (unsigned char)(v >> 16);
    dst[3] = (unsigned char)(v >> 24);
}

static inline int
read_token(PyObject *item, uint32_t *out)
{
    /* Fast path for exact ints of at most one digit (every token id below 2**30): read the value in place. */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyLong_CheckExact(item) && PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)item);
        if (v >= 0 && v <= 0xFFFFFFFF) {
            *out = (uint32_t)v;
            return 0;
        }
    }
#else
    if (PyLong_CheckExact(item) && (Py_SIZE(item) == 0 || Py_SIZE(item) == 1)) {
        *out = Py_SIZE(item) == 0 ? 0 : (uint32_t)((PyLongObject *)item)->ob_digit[0];
        return 0;
    }
#endif
    if (!PyLong_Check(item)) {
        /* numpy's integers, as protobuf's containers take them: a static type's __index__ (C code). A class defined
         * in Python is refused: its __index__ could change the list the caller is reading in place. */
        PyObject *index = NULL;
        if (!(Py_TYPE(item)->tp_flags & Py_TPFLAGS_HEAPTYPE) && PyIndex_Check(item)) {
            index = PyNumber_Index(item);
        }
        if (index == NULL) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "token ids must be integers, got %.100s", Py_TYPE(item)->tp_name);
            return -1;
        }
        int rc = read_token(index, out);
        Py_DECREF(index);
        return rc;
    }
    unsigned long value = PyLong_AsUnsignedLong(item);
    if (value == (unsigned long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "token ids must fit in uint32");
        return -1;
    }
    if (value > 0xFFFFFFFFUL) {
        PyErr_SetString(PyExc_ValueError, "token ids must fit in uint32");
        return -1;
    }
    *out = (uint32_t)value;
    return 0;
}

#endif
