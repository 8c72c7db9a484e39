// What every native/*.cc module hands Python: its XLA FFI handlers as a dict of capsules by key.
#ifndef DEW_NATIVE_MODULE_H_
#define DEW_NATIVE_MODULE_H_

#include <Python.h>

#include <cstddef>

namespace dew {

struct HandlerEntry {
  const char* key;
  void* handler;  // an XLA_FFI_DEFINE_HANDLER_SYMBOL's address
};

// {key: capsule} for `count` entries, or null with Python's error set.
inline PyObject* HandlerDict(const HandlerEntry* entries, size_t count) {
  PyObject* out = PyDict_New();
  if (out == nullptr) return nullptr;
  for (size_t i = 0; i < count; ++i) {
    PyObject* capsule = PyCapsule_New(entries[i].handler, nullptr, nullptr);
    if (capsule == nullptr || PyDict_SetItemString(out, entries[i].key, capsule) != 0) {
      Py_XDECREF(capsule);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return out;
}

}  // namespace dew

#endif  // DEW_NATIVE_MODULE_H_
