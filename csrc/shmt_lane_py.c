/*
 * shmt_lane_py.c -- shmtransport._shmt_lane: a client's fast lane (shmt_lane, shmt_kernels.h) as a
 * Python type, so that each step of a handoff is one call into C that also builds what Python
 * needs from it (the view of the bytes, the dtype, the shape, the handle's wire form), instead of
 * a cffi call wrapped in Python that unpacks and converts its results. A handoff's hot path runs
 * with cold caches, where every Python frame and every object touched costs microseconds.
 *
 * Stable ABI (Py_LIMITED_API, 3.10): one build for every CPython, like the cffi module.
 *
 * Every call holds the GIL throughout (nothing here blocks): calls on one Lane never interleave.
 * A Lane points into the object table's mappings; it keeps `keepalive` (the Python object whose
 * buffers keep them mapped) and its arena view until close(), after which every call refuses.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>
#include <sys/mman.h>

/* The kernels, compiled into this module too (one translation unit, every symbol hidden): this
 * module only uses the object table's and the wire form's, never the hashing ones. */
#define SHMT_HAVE_XXH3 0
#include "shmt_kernels.c"

typedef struct {
    PyObject_HEAD
    shmt_lane *lane;       /* process-local, mmap'ed (zero pages until a slot's count is touched) */
    size_t lane_nbytes;
    uint64_t arena_nbytes;
    PyObject *arena;       /* memoryview of the whole arena; NULL once closed */
    PyObject *keepalive;   /* holds the table's mappings; NULL once closed */
    PyObject *refuse;      /* refuse(status, index) raises the typed error of a refused slot step */
} LaneObject;

static PyObject *refused(LaneObject *self, int32_t status, uint64_t index);

static int lane_open(LaneObject *self)
{
    if (self->arena) return 1;
    refused(self, SHMT_LANE_CLOSED, 0);
    return 0;
}

static int u64_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, uint64_t *out)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return 0;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        out[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (out[i] == (uint64_t)-1 && PyErr_Occurred()) return 0;
    }
    return 1;
}

/* arena[start:start + len], a view of the mapped bytes */
static PyObject *arena_slice(LaneObject *self, uint64_t start, uint64_t len)
{
    if (start > self->arena_nbytes || len > self->arena_nbytes - start) {
        PyErr_SetString(PyExc_ValueError, "range outside the arena");
        return NULL;
    }
    PyObject *lo = PyLong_FromUnsignedLongLong(start), *hi = PyLong_FromUnsignedLongLong(start + len);
    PyObject *slice = lo && hi ? PySlice_New(lo, hi, NULL) : NULL;
    Py_XDECREF(lo);
    Py_XDECREF(hi);
    if (!slice) return NULL;
    PyObject *view = PyObject_GetItem(self->arena, slice);
    Py_DECREF(slice);
    return view;
}

/* refuse(status, index) raises: a slot status, SHMT_LANE_CLOSED, or a negative code (arguments refused) */
static PyObject *refused(LaneObject *self, int32_t status, uint64_t index)
{
    PyObject *result = PyObject_CallFunction(self->refuse, "iK", (int)status, (unsigned long long)index);
    if (!result) return NULL;
    Py_DECREF(result);
    return PyErr_Format(PyExc_RuntimeError, "refusal %d was not raised", status);
}

static PyObject *Lane_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    unsigned long long table, holds, nslots, arena_nbytes;
    unsigned int bit;
    const char *name, *owner, *instance;
    Py_ssize_t name_len, owner_len, instance_len;
    PyObject *arena, *keepalive, *refuse;
    if (kwargs && PyDict_Size(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Lane takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "KKKIy#y#y#KOOO", &table, &holds, &nslots, &bit, &name, &name_len, &owner,
                          &owner_len, &instance, &instance_len, &arena_nbytes, &arena, &keepalive, &refuse))
        return NULL;
    if (!PyCallable_Check(refuse)) {
        PyErr_SetString(PyExc_TypeError, "refuse must be callable");
        return NULL;
    }
    LaneObject *self = (LaneObject *)PyType_GenericAlloc(type, 0);
    if (!self) return NULL;
    self->lane_nbytes = shmt_lane_nbytes(nslots);
    void *memory = mmap(NULL, self->lane_nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->lane = memory;
    if (shmt_lane_init(self->lane, (uint8_t *)(uintptr_t)table, (uint8_t *)(uintptr_t)holds, nslots, bit,
                       (const uint8_t *)name, name_len, (const uint8_t *)owner, owner_len, (const uint8_t *)instance,
                       instance_len, arena_nbytes) != SHMT_OK) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_ValueError, "a lane needs aligned table memory, a session bit and ids of at most "
                                          "SHMT_LANE_ID_MAX bytes");
        return NULL;
    }
    self->arena_nbytes = arena_nbytes;
    Py_INCREF(arena);
    self->arena = arena;
    Py_INCREF(keepalive);
    self->keepalive = keepalive;
    Py_INCREF(refuse);
    self->refuse = refuse;
    return (PyObject *)self;
}

static void Lane_dealloc(LaneObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    Py_CLEAR(self->arena);
    Py_CLEAR(self->keepalive);
    Py_CLEAR(self->refuse);
    if (self->lane) munmap(self->lane, self->lane_nbytes);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

/* close(): let go of the table and the arena (the session ended); every call refuses after. */
static PyObject *Lane_close(LaneObject *self, PyObject *unused)
{
    (void)unused;
    Py_CLEAR(self->arena);
    Py_CLEAR(self->keepalive);
    Py_RETURN_NONE;
}

/* acquire_wire(data: bytes) -> (memory, dtype, shape, digest, index, generation) | None
 * One more lease on the object the handle's wire form names, checked against it; its read-only
 * view, the tensor's dtype and shape and the handle's digest. None when this call does not take
 * the handle (the general path says what is wrong with it); a refusal raises. */
static PyObject *Lane_acquire_wire(LaneObject *self, PyObject *data)
{
    if (!lane_open(self)) return NULL;
    char *buf;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(data, &buf, &n) < 0) return NULL;
    uint64_t out[SHMT_LANE_OUT];
    int32_t rc = shmt_lease_acquire_wire(self->lane, (const uint8_t *)buf, (uint64_t)n, out);
    if (rc == SHMT_WIRE_OTHER) Py_RETURN_NONE;
    if (rc != SHMT_SLOT_OK) return refused(self, rc, rc < 0 ? 0 : out[3]);
    uint64_t ndim = out[8], size = out[1];
    PyObject *shape = PyTuple_New((Py_ssize_t)ndim);
    if (!shape) goto undo;
    for (uint64_t i = 0; i < ndim; i++) {
        if (out[9 + i] == 0) size = 0; /* a zero-size tensor occupies 1 byte */
        PyObject *dim = PyLong_FromUnsignedLongLong(out[9 + i]);
        if (!dim || PyTuple_SetItem(shape, (Py_ssize_t)i, dim) < 0) {
            Py_DECREF(shape);
            goto undo;
        }
    }
    PyObject *memory = arena_slice(self, out[0], size);
    PyObject *dtype = PyUnicode_DecodeASCII(buf + out[4], (Py_ssize_t)out[5], NULL);
    PyObject *digest = PyBytes_FromStringAndSize(buf + out[6], (Py_ssize_t)out[7]);
    if (!memory || !dtype || !digest) {
        Py_XDECREF(memory);
        Py_XDECREF(dtype);
        Py_XDECREF(digest);
        Py_DECREF(shape);
        goto undo;
    }
    return Py_BuildValue("(NNNNKK)", memory, dtype, shape, digest, (unsigned long long)out[3],
                         (unsigned long long)out[2]);
undo: /* out of memory: the lease just taken goes back */
    shmt_lease_release(self->lane, out[3], out[2]);
    return NULL;
}

/* acquire(index, generation, offset, nbytes) -> status: one more lease, counted. */
static PyObject *Lane_acquire(LaneObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t a[4];
    if (!lane_open(self) || !u64_args(args, nargs, 4, a)) return NULL;
    return PyLong_FromLong(shmt_lease_acquire(self->lane, a[0], a[1], a[2], a[3]));
}

/* release(index, generation) -> status: one lease less (SHMT_SLOT_NOT_HELD: none was held). */
static PyObject *Lane_release(LaneObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t a[2];
    if (!lane_open(self) || !u64_args(args, nargs, 2, a)) return NULL;
    return PyLong_FromLong(shmt_lease_release(self->lane, a[0], a[1]));
}

static PyObject *Lane_lease_count(LaneObject *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromUnsignedLongLong(shmt_lease_count(self->lane));
}

static PyObject *Lane_release_all(LaneObject *self, PyObject *unused)
{
    (void)unused;
    if (!lane_open(self)) return NULL;
    return PyLong_FromUnsignedLongLong(shmt_lease_release_all(self->lane));
}

/* place(space, nbytes, view_nbytes, dtype: bytes, shape: tuple)
 *   -> (offset, generation, index, wire: bytes, memory) | None
 * A new object of `nbytes` in the grant at address `space` and its handle's wire form, with a
 * writable view of its first `view_nbytes` bytes. None when the grant has no room; a refused
 * publish raises, as do more than SHMT_WIRE_MAX_DIMS dims or a dtype name past 64 bytes (no
 * tensor has them: shmtransport.tensors refuses them first). */
static PyObject *Lane_place(LaneObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t a[3];
    if (!lane_open(self) || nargs != 5 || !u64_args(args, 3, 3, a)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "place(space, nbytes, view_nbytes, dtype, shape)");
        return NULL;
    }
    char *dtype;
    Py_ssize_t dtype_len;
    if (PyBytes_AsStringAndSize(args[3], &dtype, &dtype_len) < 0) return NULL;
    if (!PyTuple_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "shape must be a tuple");
        return NULL;
    }
    Py_ssize_t ndim = PyTuple_Size(args[4]);
    if (ndim > SHMT_WIRE_MAX_DIMS || dtype_len > 64) return refused(self, SHMT_EINVAL, 0);
    uint64_t dims[SHMT_WIRE_MAX_DIMS];
    for (Py_ssize_t i = 0; i < ndim; i++) {
        dims[i] = PyLong_AsUnsignedLongLong(PyTuple_GetItem(args[4], i));
        if (dims[i] == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    }
    uint64_t out[4];
    /* every field's tag and length take at most 3 + 10 bytes, each dim at most 10 */
    uint8_t wire[13 * 12 + 10 * SHMT_WIRE_MAX_DIMS + 3 * SHMT_LANE_ID_MAX + 64];
    shmt_grant_space *space = (shmt_grant_space *)(uintptr_t)a[0];
    int32_t rc = shmt_lane_place(self->lane, space, a[1], (const uint8_t *)dtype, (uint64_t)dtype_len,
                                 (const uint8_t *)dims, (uint64_t)ndim, out, wire, sizeof wire);
    if (rc == SHMT_GRANT_NO_ROOM) Py_RETURN_NONE;
    if (rc != SHMT_OK) return refused(self, rc, out[2]);
    PyObject *memory = arena_slice(self, out[0], a[2] < a[1] ? a[2] : a[1]);
    PyObject *wire_bytes = PyBytes_FromStringAndSize((const char *)wire, (Py_ssize_t)out[3]);
    if (!memory || !wire_bytes) {
        Py_XDECREF(memory);
        Py_XDECREF(wire_bytes);
        uint64_t remaining;
        shmt_lane_release_own(self->lane, space, out[2], out[1], 1, &remaining);
        return NULL;
    }
    return Py_BuildValue("(KKKNN)", (unsigned long long)out[0], (unsigned long long)out[1],
                         (unsigned long long)out[2], wire_bytes, memory);
}

/* commit(index, generation, deadline_ns, hold) -> status */
static PyObject *Lane_commit(LaneObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t a[4];
    if (!lane_open(self) || !u64_args(args, nargs, 4, a)) return NULL;
    return PyLong_FromLong(shmt_lane_commit(self->lane, a[0], a[1], a[2], a[3] != 0));
}

/* release_own(space, index, generation, cancel_handoff) -> (status, holders left) */
static PyObject *Lane_release_own(LaneObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t a[4], remaining = 0;
    if (!lane_open(self) || !u64_args(args, nargs, 4, a)) return NULL;
    int32_t rc = shmt_lane_release_own(self->lane, (shmt_grant_space *)(uintptr_t)a[0], a[1], a[2], a[3] != 0,
                                       &remaining);
    return Py_BuildValue("(iK)", (int)rc, (unsigned long long)remaining);
}

static PyMethodDef Lane_methods[] = {
    {"acquire_wire", (PyCFunction)Lane_acquire_wire, METH_O, NULL},
    {"acquire", (PyCFunction)(void (*)(void))Lane_acquire, METH_FASTCALL, NULL},
    {"release", (PyCFunction)(void (*)(void))Lane_release, METH_FASTCALL, NULL},
    {"lease_count", (PyCFunction)Lane_lease_count, METH_NOARGS, NULL},
    {"release_all", (PyCFunction)Lane_release_all, METH_NOARGS, NULL},
    {"place", (PyCFunction)(void (*)(void))Lane_place, METH_FASTCALL, NULL},
    {"commit", (PyCFunction)(void (*)(void))Lane_commit, METH_FASTCALL, NULL},
    {"release_own", (PyCFunction)(void (*)(void))Lane_release_own, METH_FASTCALL, NULL},
    {"close", (PyCFunction)Lane_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Lane_slots[] = {
    {Py_tp_new, Lane_new},
    {Py_tp_dealloc, Lane_dealloc},
    {Py_tp_methods, Lane_methods},
    {Py_tp_doc, "A client's fast lane into its object table (see shmtransport.table_lane)."},
    {0, NULL},
};

static PyType_Spec Lane_spec = {
    "shmtransport._shmt_lane.Lane", sizeof(LaneObject), 0, Py_TPFLAGS_DEFAULT, Lane_slots,
};

static int module_exec(PyObject *module)
{
    PyObject *type = PyType_FromSpec(&Lane_spec);
    if (!type || PyModule_AddObject(module, "Lane", type) < 0) {
        Py_XDECREF(type);
        return -1;
    }
    if (PyModule_AddStringConstant(module, "PACKAGE_VERSION", SHMT_PACKAGE_VERSION) < 0 ||
        PyModule_AddIntConstant(module, "LANE_CLOSED", SHMT_LANE_CLOSED) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, module_exec}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "shmtransport._shmt_lane", NULL, 0, NULL, module_slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__shmt_lane(void) { return PyModuleDef_Init(&module_def); }
