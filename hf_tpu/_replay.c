/* The check `hf_tpu.trace_inputs.KeptWalk.replay` makes on every call of a traced prefill or decode loop:
whether the dicts a state walk read (each submodule's `__dict__`, `_parameters`, `_buffers`, `_modules`; a
static cache's attributes) still hold the same keys, in the same order, and which entries now hold another
object.

A 16-layer Llama's walk read 860 dicts with 4836 entries. In Python (a pass for the keys, one to
collect the values, one comparing them) that took about 0.3 ms of a 0.6 ms replay on the development CPU,
whose Python runs several times faster than the TPU v5e's host. Here it is one pass with `PyDict_Next`,
comparing pointers. See docs/design/compile-latency.md.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* changed_entries(dicts, keys, values) -> None where the dicts' keys are not `keys` (in order), else the
   list of (now, before) pairs of the entries whose value is not the very object in `values`. */
static PyObject *changed_entries(PyObject *self, PyObject *args) {
    PyObject *dicts, *keys, *values;
    if (!PyArg_ParseTuple(args, "O!O!O!:changed_entries", &PyList_Type, &dicts, &PyList_Type, &keys,
                          &PyList_Type, &values))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(values) != count) {
        PyErr_SetString(PyExc_ValueError, "changed_entries: keys and values differ in length");
        return NULL;
    }
    PyObject *changed = PyList_New(0);
    if (changed == NULL)
        return NULL;
    Py_ssize_t entry = 0;
    for (Py_ssize_t d = 0; d < PyList_GET_SIZE(dicts); d++) {
        PyObject *dict = PyList_GET_ITEM(dicts, d);
        if (!PyDict_Check(dict)) {
            Py_DECREF(changed);
            PyErr_SetString(PyExc_TypeError, "changed_entries: dicts must hold dicts");
            return NULL;
        }
        Py_ssize_t position = 0;
        PyObject *key, *value;
        while (PyDict_Next(dict, &position, &key, &value)) {
            if (entry == count)
                goto different_keys;
            PyObject *before_key = PyList_GET_ITEM(keys, entry);
            /* an attribute name is usually the interned string itself; an equal string built at run time
               is the same key. Only exact strings are compared, which runs no Python code that could
               change the dict being iterated; any other key that is not the same object differs. */
            if (key != before_key) {
                if (!PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(before_key))
                    goto different_keys;
                int equal = PyObject_RichCompareBool(key, before_key, Py_EQ);
                if (equal < 0) {
                    Py_DECREF(changed);
                    return NULL;
                }
                if (!equal)
                    goto different_keys;
            }
            PyObject *before = PyList_GET_ITEM(values, entry);
            if (value != before) {
                PyObject *pair = PyTuple_Pack(2, value, before);
                if (pair == NULL || PyList_Append(changed, pair) < 0) {
                    Py_XDECREF(pair);
                    Py_DECREF(changed);
                    return NULL;
                }
                Py_DECREF(pair);
            }
            entry++;
        }
    }
    if (entry == count)
        return changed;
different_keys:
    Py_DECREF(changed);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"changed_entries", changed_entries, METH_VARARGS,
     "changed_entries(dicts, keys, values): None where the dicts' keys are not `keys` in order, else the "
     "(now, before) pairs of the entries that hold another object than `values` says."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_replay", NULL, -1, methods};

PyMODINIT_FUNC PyInit__replay(void) { return PyModule_Create(&module); }
