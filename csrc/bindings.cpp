// The only pybind11 file: pyddp._C. It sees backend/ (and, for the
// _testing submodule, the pure schedule and kernel helpers). Every call
// that can wait releases the GIL.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "algorithms/schedule.h"
#include "backend/ring_backend.h"
#include "common/check.h"
#include "kernels/cpu.h"
#include "transport/shm.h"

#include <sys/stat.h>

namespace py = pybind11;
using namespace pyddp;

namespace {

DataType dtypeOf(const at::Tensor& t) {
  const auto d = dataTypeOf(t.scalar_type());
  PYDDP_CHECK_TYPE(d.has_value(), "unsupported dtype ", t.scalar_type());
  return *d;
}

void bindTesting(py::module_& m) {
  auto t = m.def_submodule(
      "_testing", "Pure helpers exposed for unit tests; not a public API.");
  t.def("balanced_block", [](size_t count, int n, int b) {
    const auto r = schedule::balancedBlock(count, n, b);
    return std::make_pair(r.begin, r.count);
  });
  t.def("send_block", &schedule::sendBlock);
  t.def("recv_block", &schedule::recvBlock);
  t.def("piece", [](size_t count, size_t pieceElems, size_t p) {
    const auto r = schedule::piece(count, pieceElems, p);
    return std::make_pair(r.begin, r.count);
  });
  t.def("num_pieces", &schedule::numPieces);
  t.def("chain_position", &schedule::chainPosition);
  // The CPU kernels over contiguous tensors; partials are float32 for half
  // types and the element type otherwise.
  auto partialLike = [](const at::Tensor& local) {
    const bool half = local.scalar_type() == at::kHalf || local.scalar_type() == at::kBFloat16;
    return at::empty(local.sizes(), local.options().dtype(half ? at::kFloat : local.scalar_type()));
  };
  t.def("to_partial", [=](at::Tensor local) {
    auto out = partialLike(local);
    kernels::toPartial({dtypeOf(local), RedOp::Sum, 1}, out.data_ptr(), local.data_ptr(),
                       local.numel());
    return out;
  });
  t.def("reduce_partial", [=](RedOp op, int worldSize, at::Tensor partial, at::Tensor local) {
    auto out = partialLike(local);
    kernels::reducePartial({dtypeOf(local), op, worldSize}, out.data_ptr(),
                           partial.data_ptr(), local.data_ptr(), local.numel());
    return out;
  });
  t.def("reduce_final", [](RedOp op, int worldSize, at::Tensor partial, at::Tensor local) {
    auto out = at::empty_like(local), out2 = at::empty_like(local);
    kernels::reduceFinal({dtypeOf(local), op, worldSize}, out.data_ptr(), out2.data_ptr(),
                         partial.data_ptr(), local.data_ptr(), local.numel());
    return std::make_pair(out, out2);
  });
  // Creates one shm segment as a group's bootstrap does, reports its name and
  // permission bits, and destroys it without ever connecting.
  t.def("probe_shm_segment", [] {
    shm::ShmTransport transport(0, 2, RingOptions::fromEnv());
    const std::string blob = transport.setup();
    const std::string name = blob.substr(0, blob.find('\n'));
    struct stat st {};
    PYDDP_CHECK(stat(("/dev/shm" + name).c_str(), &st) == 0, "segment ", name, " not found");
    return std::make_pair(name, static_cast<int>(st.st_mode & 0777));
  });
  t.def("reduce_n", [](RedOp op, int worldSize, std::vector<at::Tensor> srcs) {
    auto out = at::empty_like(srcs.at(0));
    std::vector<const void*> ptrs;
    for (auto& s : srcs) ptrs.push_back(s.data_ptr());
    kernels::reduceN({dtypeOf(srcs[0]), op, worldSize}, out.data_ptr(), ptrs.data(),
                     static_cast<int>(ptrs.size()), out.numel());
    return out;
  });
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyddp's C++ core. Use the pyddp package, not this module.";

  py::enum_<RedOp>(m, "RedOp")
      .value("SUM", RedOp::Sum)
      .value("AVG", RedOp::Avg)
      .value("PRODUCT", RedOp::Product)
      .value("MIN", RedOp::Min)
      .value("MAX", RedOp::Max);

  py::enum_<Algo>(m, "Algo")
      .value("AUTO", Algo::Auto)
      .value("RING", Algo::Ring)
      .value("DIRECT", Algo::Direct)
      .value("TWO_SHOT", Algo::TwoShot);

  py::class_<RingOptions>(m, "RingOptions")
      .def(py::init(&RingOptions::fromEnv), "RingOptions with defaults from PYDDP_* variables.")
      .def(py::init<const RingOptions&>(), "A copy.")
      .def_readwrite("slot_bytes", &RingOptions::slotBytes)
      .def_readwrite("num_slots", &RingOptions::numSlots)
      .def_readwrite("direct_max_bytes", &RingOptions::directMaxBytes)
      .def_readwrite("two_shot_max_bytes", &RingOptions::twoShotMaxBytes)
      .def_readwrite("algo", &RingOptions::algo)
      .def_readwrite("timeout_ms", &RingOptions::timeoutMs)
      .def("validate", &RingOptions::validate);

  m.def("settings", &settings, "Every PYDDP_* environment variable and its value.");

  const auto release = py::call_guard<py::gil_scoped_release>();
  py::class_<RingBackend, c10d::Backend, c10::intrusive_ptr<RingBackend>>(m, "RingBackend")
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int, const RingOptions&>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"), release)
      .def("all_reduce", &RingBackend::allReduce, py::arg("tensor"), py::arg("op"),
           py::arg("async_op"), release)
      .def("all_gather_single", &RingBackend::allGatherSingle, py::arg("output"),
           py::arg("input"), py::arg("async_op"), release)
      .def("all_gather", &RingBackend::allGatherList, py::arg("tensor_list"),
           py::arg("tensor"), py::arg("async_op"), release)
      .def("broadcast", &RingBackend::broadcastFrom, py::arg("tensor"), py::arg("src"),
           py::arg("async_op"), release)
      .def("reduce_scatter_single", &RingBackend::reduceScatterSingle, py::arg("output"),
           py::arg("input"), py::arg("op"), py::arg("async_op"), release)
      .def("barrier", &RingBackend::barrierAll, py::arg("async_op"), release)
      .def("shutdown", &RingBackend::shutdown, release)
      .def_property_readonly("options", &RingBackend::options);

  bindTesting(m);
}
