/* The storage of a new `tpu` tensor, handed to PyTorch as a DLPack capsule.

DLPack is the one public door through which Python can give PyTorch a storage with a deleter on a
PrivateUse1 device. Building the DLManagedTensor here, rather than rewriting one of NumPy's from
Python through ctypes, takes one call instead of five; the deleter tells `buffer.py` the storage died
by calling `on_free(address)`, holding the GIL and keeping any exception that is propagating (storages
often die while one does) as it was. See docs/design/native-hot-path.md.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

/* DLPack v0.8's structs (dlpack.h), which PyTorch's `_from_dlpack` reads from a "dltensor" capsule. */
typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

enum { kDLExtDev = 12 }; /* PyTorch maps it to PrivateUse1: `tpu` */

/* One allocation: the DLManagedTensor, who to tell when it dies, and the shape it points at. */
typedef struct {
    DLManagedTensor managed;
    PyObject *on_free;
    int64_t shape[];
} Storage;

static void storage_deleter(DLManagedTensor *managed) {
    Storage *storage = (Storage *)managed;
#if PY_VERSION_HEX >= 0x030D0000
    int finalizing = Py_IsFinalizing();
#else
    int finalizing = _Py_IsFinalizing();
#endif
    if (!finalizing) { /* at exit the allocator's tables are gone with the interpreter */
        PyGILState_STATE gil = PyGILState_Ensure();
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *address = PyLong_FromUnsignedLongLong((uintptr_t)managed->dl_tensor.data);
        PyObject *result = address ? PyObject_CallOneArg(storage->on_free, address) : NULL;
        if (result == NULL) {
            PyErr_WriteUnraisable(storage->on_free);
        }
        Py_XDECREF(result);
        Py_XDECREF(address);
        Py_DECREF(storage->on_free);
        PyErr_Restore(type, value, traceback);
        PyGILState_Release(gil);
    }
    free(storage);
}

/* A capsule PyTorch never consumed (it renames the ones it takes to "used_dltensor") frees its storage. */
static void capsule_destructor(PyObject *capsule) {
    if (PyCapsule_IsValid(capsule, "dltensor")) { /* sets no error: one may be propagating */
        DLManagedTensor *managed = PyCapsule_GetPointer(capsule, "dltensor");
        managed->deleter(managed);
    }
}

/* storage_capsule(address, device_index, dtype_code, dtype_bits, shape, on_free) */
static PyObject *storage_capsule(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyTuple_Check(args[4]) || !PyCallable_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError,
                        "storage_capsule(address, device_index, dtype_code, dtype_bits, shape: tuple, on_free)");
        return NULL;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(args[0]);
    long device_index = PyLong_AsLong(args[1]);
    long code = PyLong_AsLong(args[2]);
    long bits = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t ndim = PyTuple_GET_SIZE(args[4]);
    Storage *storage = malloc(sizeof(Storage) + (ndim ? ndim : 1) * sizeof(int64_t));
    if (storage == NULL) {
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < ndim; i++) {
        storage->shape[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[4], i));
    }
    if (PyErr_Occurred()) {
        free(storage);
        return NULL;
    }
    DLTensor *tensor = &storage->managed.dl_tensor;
    tensor->data = (void *)(uintptr_t)address;
    tensor->device.device_type = kDLExtDev;
    tensor->device.device_id = (int32_t)device_index;
    tensor->ndim = (int32_t)ndim;
    tensor->dtype.code = (uint8_t)code;
    tensor->dtype.bits = (uint8_t)bits;
    tensor->dtype.lanes = 1;
    tensor->shape = storage->shape;
    tensor->strides = NULL; /* compact row-major */
    tensor->byte_offset = 0;
    storage->managed.manager_ctx = NULL;
    storage->managed.deleter = storage_deleter;
    Py_INCREF(args[5]);
    storage->on_free = args[5];
    PyObject *capsule = PyCapsule_New(&storage->managed, "dltensor", capsule_destructor);
    if (capsule == NULL) {
        Py_DECREF(storage->on_free);
        free(storage);
    }
    return capsule;
}

static PyMethodDef methods[] = {
    {"storage_capsule", (PyCFunction)(void (*)(void))storage_capsule, METH_FASTCALL,
     "A DLPack capsule for a tpu storage at `address`; `on_free(address)` is called when it dies."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_capsule", NULL, -1, methods};

PyMODINIT_FUNC PyInit__capsule(void) { return PyModule_Create(&module); }
