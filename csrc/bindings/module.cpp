// lily._core: the native extension. Each area registers itself through one init_<area>() function.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "../runtime/backend.h"
#include "../runtime/common.h"

namespace nb = nanobind;

void init_engine(nb::module_& m);
void init_ops(nb::module_& m);

NB_MODULE(_core, m) {
  m.doc() = "lily native core: weights, sessions and the forward pass on each backend";
  // lily::Error surfaces as the Python lily.errors.LilyError, so callers catch one type.
  static nb::object lily_error = nb::module_::import_("lily.errors").attr("LilyError");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const lily::Error& e) {
      PyErr_SetString(lily_error.ptr(), e.what());
    }
  });
  m.def("backend_available", [](const std::string& device) {
    return lily::backend_available(lily::parse_device(device));
  }, "Whether this build has a backend for the device ('cpu', 'cuda', 'metal') and it can run here.");
  init_engine(m);
  init_ops(m);
}
