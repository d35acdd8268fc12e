// The only pybind11 file of pyddp._C's public face: options, the engines
// (bound once, through their base class) and the registry that makes them.
// It sees backend/ and common/ only. Every call that can wait releases the
// GIL. The test-only helpers live in csrc/testing/.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/extension.h>
#include <torch/version.h>

#include "backend/engine_registry.h"
#include "backend/ring_engine.h"
#include "common/check.h"
#include "common/config.h"

#ifdef PYDDP_WITH_CUDA
#include "backend/nccl_engine.h"
#endif

#ifdef PYDDP_WITH_TESTING
#include "testing/bind.h"
#endif

namespace py = pybind11;
using namespace pyddp;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pyddp's C++ core. Use the pyddp package, not this module.";
  const auto release = py::call_guard<py::gil_scoped_release>();

  // What the import-time check compares with the running torch.
  m.attr("torch_version") = TORCH_VERSION;
#ifdef PYDDP_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def("nccl_version", [] {
    const auto v = nccl::version();
    return py::make_tuple(v[0], v[1], v[2]);
  }, "The NCCL library's version: (major, minor, patch).");
#else
  m.attr("has_cuda") = false;
#endif

  py::enum_<RedOp>(m, "RedOp")
      .value("SUM", RedOp::Sum)
      .value("AVG", RedOp::Avg)
      .value("PRODUCT", RedOp::Product)
      .value("MIN", RedOp::Min)
      .value("MAX", RedOp::Max);

  py::enum_<Algo>(m, "Algo", "How an all-reduce runs: by size (AUTO), or forced.")
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

  py::class_<Engine, c10d::Backend, c10::intrusive_ptr<Engine>>(
      m, "Engine", "Runs a group's collectives for the tensors of one device.")
      .def("all_reduce", &Engine::allReduce, py::arg("tensor"), py::arg("op"),
           py::arg("async_op"), release)
      .def("all_gather_single", &Engine::allGatherSingle, py::arg("output"), py::arg("input"),
           py::arg("async_op"), release)
      .def("all_gather", &Engine::allGatherList, py::arg("tensor_list"), py::arg("tensor"),
           py::arg("async_op"), release)
      .def("broadcast", &Engine::broadcastFrom, py::arg("tensor"), py::arg("src"),
           py::arg("async_op"), release)
      .def("reduce_scatter_single", &Engine::reduceScatterSingle, py::arg("output"),
           py::arg("input"), py::arg("op"), py::arg("async_op"), release)
      .def("barrier", &Engine::barrierAll, py::arg("async_op"), release)
      .def("reduce", &Engine::reduceTo, py::arg("tensor"), py::arg("op"), py::arg("dst"),
           py::arg("async_op"), release)
      .def("gather", &Engine::gatherTo, py::arg("gather_list"), py::arg("tensor"),
           py::arg("dst"), py::arg("async_op"), release)
      .def("scatter", &Engine::scatterFrom, py::arg("tensor"), py::arg("scatter_list"),
           py::arg("src"), py::arg("async_op"), release)
      .def("shutdown", &Engine::shutdown, release)
      .def_property_readonly("device", &Engine::device)
      .def_property_readonly("transport", &Engine::transport);

  py::class_<RingEngine, Engine, c10::intrusive_ptr<RingEngine>>(
      m, "RingEngine", "pyddp's ring and direct algorithms over a transport.")
      .def_property_readonly("options", &RingEngine::options);
#ifdef PYDDP_WITH_CUDA
  py::class_<NcclEngine, Engine, c10::intrusive_ptr<NcclEngine>>(
      m, "NcclEngine", "NCCL's own collectives.")
      .def_property_readonly("timeout_ms", [](const NcclEngine& e) { return e.timeout().count(); });
#endif

  m.def("backend_names", &backendNames, "The backend names this build serves.");
  m.def("device_types_of", &deviceTypesOf, py::arg("backend"),
        "The device types (\"cpu\", \"cuda\") a group of `backend` serves.");
  m.def(
      "make_engine",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
         const RingOptions& options, c10::Device device, const std::string& backend) {
        EngineChoice choice = makeEngine(store, rank, size, options, device, backend);
        return std::make_pair(choice.engine, choice.refusals);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("options"), py::arg("device"),
      py::arg("backend"), release,
      "(engine, refusals): the engine of `backend` for `device`, and why each candidate "
      "before it was passed over.");

#ifdef PYDDP_WITH_TESTING
  testing::bindTesting(m);
#endif
}
