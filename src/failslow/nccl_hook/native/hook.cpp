// The collective hook's per-call work in C++ (greyhound 4.2: the Monitor logs each
// communication call's type and timestamps into shared memory at negligible cost).
//
// failslow/nccl_hook/capture.py registers a kernel for the Autograd dispatch key of every c10d
// op (c10d_ops.py). In Python that kernel costs ~0.3 ms of a DDP rank's training thread per
// call (boxing into Python, the GIL taken on the autograd thread and again by every completion
// callback on the backend's threads; benchmarks/tracking_overhead.py --kernel). This file is the
// same kernel without Python on the common path:
//
//   - one boxed kernel for every op: read the op's arguments per its spec (set from c10d_ops.py
//     at install), stamp the start under the ring writer's lock (settled_ns, ring.py), run the
//     op below autograd, and write the record from a C++ callback on the Work's future (or from
//     a watcher thread polling works without one, or at return for gloo's reduce-scatter);
//   - the ring writer itself (ring.h: commit word last, write_index by fetch-and-add, as the C
//     shim does), shared with the Python side, which writes its step markers through it;
//   - the per-group key and call counter (groups.py), registered from Python.
//
// Python is called (with the GIL) only where it decides: a group not seen before, a pause
// requested in the ring header (trap.py), and the ring not open yet.

#include <torch/extension.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#define _Static_assert static_assert
extern "C" {
#include "ring.h"
}
#undef _Static_assert

namespace py = pybind11;

namespace {

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// -- the ring writer -----------------------------------------------------------------------

class Ring {
 public:
  explicit Ring(const std::string& path) {
    int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    TORCH_CHECK(fd >= 0, "failslow: cannot open ring ", path);
    struct stat st;
    TORCH_CHECK(fstat(fd, &st) == 0, "failslow: cannot stat ring ", path);
    size_ = size_t(st.st_size);
    void* map = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    TORCH_CHECK(map != MAP_FAILED, "failslow: cannot map ring ", path);
    hdr_ = static_cast<fls_ring_header*>(map);
    rec_ = reinterpret_cast<fls_record*>(static_cast<char*>(map) + FLS_HEADER_SIZE);
    mask_ = hdr_->capacity - 1;
    TORCH_CHECK(size_ >= FLS_HEADER_SIZE + hdr_->capacity * FLS_RECORD_SIZE,
                "failslow: ring ", path, " is shorter than its header says");
  }
  ~Ring() { munmap(hdr_, size_); }
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // (token, t_start): the call stays in flight (settled_ns at or before it) until finish().
  std::pair<uint64_t, int64_t> begin() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t t = now_ns();
    uint64_t token = ++token_;
    inflight_.emplace(token, t);
    if (inflight_.size() == 1) __atomic_store_n(&hdr_->settled_ns, t, __ATOMIC_RELEASE);
    return {token, t};
  }

  // Writes one record (commit word last); token 0: a record without a begin() (a marker).
  uint64_t write(int64_t t_start, int64_t t_end, uint64_t nbytes, uint64_t key,
                 uint64_t call_index, int op, int dtype, int source, int flags, int32_t peer,
                 uint64_t token) {
    uint64_t i = fls_ring_emit(hdr_, rec_, mask_, t_start, t_end, nbytes, key, call_index, op,
                               dtype, source, flags, peer);
    settle(token);
    return i;
  }

  // The call of `token` is written or given up: settle past it.
  void settle(uint64_t token) {
    std::lock_guard<std::mutex> lock(mu_);
    if (token != 0) inflight_.erase(token);
    if (token_ == 0) return;  // no call ever began: settled_ns stays 0 (unknown)
    int64_t t = inflight_.empty() ? now_ns() : inflight_.begin()->second;
    __atomic_store_n(&hdr_->settled_ns, t, __ATOMIC_RELEASE);
  }

  void count_dropped(uint64_t n) { __atomic_fetch_add(&hdr_->dropped, n, __ATOMIC_ACQ_REL); }
  uint64_t control() const { return __atomic_load_n(&hdr_->control, __ATOMIC_ACQUIRE); }

 private:
  fls_ring_header* hdr_ = nullptr;
  fls_record* rec_ = nullptr;
  uint64_t mask_ = 0;
  size_t size_ = 0;
  std::mutex mu_;
  uint64_t token_ = 0;
  std::map<uint64_t, int64_t> inflight_;  // tokens are issued in time order
};

// -- ops and groups ------------------------------------------------------------------------

struct OpSpec {
  int op = 0;
  int input_arg = 0;
  bool payload = true;  // false: the input tensor carries no payload (a barrier)
  int pg_arg = 0;
  int peer_arg = -1;
  int async_arg = -1;
  bool coalesced = false;
  bool at_return = false;   // gloo reduce-scatter works never report completion
  bool any_source = false;  // recv_any_source_: the peer is known at completion
};

struct Group {
  uint64_t key = 0;
  std::vector<int32_t> ranks;
  bool defer = false;  // the C shim records this group's calls (NCCL under the shim)
  std::atomic<uint64_t> calls{0};
  int32_t global_rank(int64_t group_rank) const {
    return group_rank >= 0 && size_t(group_rank) < ranks.size() ? ranks[group_rank] : -1;
  }
};

struct PauseCall {
  uint64_t call_index;
  uint64_t token;
  int64_t t_start;
};

struct Pending {  // one call whose record is written at completion
  std::shared_ptr<Ring> ring;
  std::shared_ptr<Group> group;
  c10::intrusive_ptr<c10d::Work> work;  // set for watched works and recv from any source
  int64_t t_start;
  uint64_t nbytes, call_index, token;
  int op, dtype, flags;
  int32_t peer;
};

constexpr int kFailed = FLS_FL_FAILED;
constexpr int kEndIsEnqueue = FLS_FL_END_IS_ENQUEUE;

void finish(Pending& p, int64_t t_end, bool failed) {
  int flags = p.flags | (failed ? kFailed : 0);
  if (p.work && !failed && p.peer < 0) {  // recv from any source
    try {
      p.peer = p.group->global_rank(p.work->sourceRank());
    } catch (...) {
    }
  }
  p.ring->write(p.t_start, t_end, p.nbytes, p.group->key, p.call_index, p.op, p.dtype,
                FLS_SRC_PYTHON, flags, p.peer, p.token);
}

// Works without a future (gloo send/recv): polled on one thread while any are pending.
class Watcher {
 public:
  void watch(Pending p) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(std::move(p));
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();  // lives as long as the process
    }
    cv_.notify_one();
  }

 private:
  static constexpr int64_t kGiveUpNs = 600LL * 1000000000LL;
  void run() {
    for (;;) {
      std::vector<Pending> items;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !pending_.empty(); });
        items.swap(pending_);
      }
      std::vector<Pending> keep;
      for (auto& p : items) {
        try {
          if (!p.work->isCompleted()) {
            if (now_ns() - p.t_start < kGiveUpNs) {
              keep.push_back(std::move(p));
              continue;
            }
            p.flags |= kEndIsEnqueue;  // never seen complete: give up
            finish(p, p.t_start, false);
            continue;
          }
          finish(p, now_ns(), p.work->exception() != nullptr);
        } catch (...) {
          p.ring->count_dropped(1);
          p.ring->settle(p.token);
        }
      }
      if (!keep.empty()) {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& p : keep) pending_.push_back(std::move(p));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Pending> pending_;
  bool started_ = false;
};

// -- the hook ------------------------------------------------------------------------------

struct Hook {
  std::unique_ptr<torch::Library> lib;
  std::atomic<bool> active{false};
  std::unordered_map<std::string, OpSpec> specs;  // written at install, read-only after
  int dtypes[256] = {0};  // c10::ScalarType -> events.py DType code, likewise (0: UNKNOWN)
  std::shared_mutex groups_mu;
  std::unordered_map<std::string, std::shared_ptr<Group>> groups;  // by torch group name
  std::shared_ptr<Ring> ring;  // guarded by ring_mu (a shared_ptr copy per call)
  std::mutex ring_mu;
  py::object capture;  // the Python Capture: slow paths (a new group, the trap, no ring yet)
  std::mutex pause_mu;
  std::string pause_group;
  std::deque<PauseCall> pause_calls;
  Watcher* watcher = new Watcher();  // never freed: its thread may outlive any owner
};

Hook* hook() {
  static Hook* h = new Hook();  // never freed: callbacks may run during interpreter exit
  return h;
}

thread_local bool t_busy = false;

std::shared_ptr<Ring> current_ring() {
  Hook* h = hook();
  std::lock_guard<std::mutex> lock(h->ring_mu);
  return h->ring;
}

std::shared_ptr<Group> find_group(const std::string& name) {
  Hook* h = hook();
  std::shared_lock<std::shared_mutex> lock(h->groups_mu);
  auto it = h->groups.find(name);
  return it == h->groups.end() ? nullptr : it->second;
}

int dtype_code(c10::ScalarType t) {  // from c10d_ops.py's table (install)
  return hook()->dtypes[static_cast<uint8_t>(t)];
}

// Bytes of a payload argument (a tensor, a list of them, or a list of lists) and the dtype
// code of its first tensor (c10d_ops.py: the op's nbytes function and payload_dtype).
uint64_t payload_nbytes(const c10::IValue& v, int* dtype) {
  uint64_t n = 0;
  auto add = [&](const at::Tensor& t) {
    if (*dtype < 0) *dtype = dtype_code(t.scalar_type());
    n += uint64_t(t.numel()) * t.element_size();
  };
  if (v.isTensor()) {
    add(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) add(t);
  } else if (v.isList()) {
    for (const c10::IValue& inner : v.toListRef()) {
      if (inner.isTensorList())
        for (const at::Tensor& t : inner.toTensorVector()) add(t);
    }
  }
  return n;
}

// Python slow paths: each takes the GIL; a failure there drops the record, never the call.
void call_python(const char* method, const c10::IValue* pg) {
  py::gil_scoped_acquire gil;
  py::object capture = hook()->capture;
  if (!capture) return;
  if (pg != nullptr)
    capture.attr(method)(torch::jit::toPyObject(*pg));
  else
    capture.attr(method)();
}

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  Hook* h = hook();
  auto below = [&] { op.redispatchBoxed(ks & c10::after_autograd_keyset, stack); };
  if (t_busy || !h->active.load(std::memory_order_acquire)) return below();
  auto spec_it = h->specs.find(op.schema().name());
  if (spec_it == h->specs.end()) return below();
  const OpSpec& spec = spec_it->second;
  size_t nargs = op.schema().arguments().size();
  TORCH_INTERNAL_ASSERT(stack->size() >= nargs);
  const c10::IValue* args = &(*stack)[stack->size() - nargs];
  t_busy = true;  // a collective issued from inside this call (a parked trap) is not recorded
  struct Reset {
    ~Reset() { t_busy = false; }
  } reset;

  std::shared_ptr<Ring> ring = current_ring();
  std::shared_ptr<Group> group;
  const c10::IValue& pg_iv = args[spec.pg_arg];
  std::string name;
  try {
    auto pg = pg_iv.toCustomClass<c10d::ProcessGroup>();
    name = pg->getGroupName();
    group = find_group(name);
    if (!group || !ring) {  // a group not seen before / the ring not open yet
      call_python("_native_resolve", &pg_iv);
      group = find_group(name);
      ring = current_ring();
    }
    if (ring && ring->control() != 0) call_python("_native_trap", &pg_iv);  // trap.py
  } catch (const std::exception&) {
    group = nullptr;
  }
  if (!group || !ring) return below();
  if (group->defer) return below();  // the C shim records it, with NCCL's own timing

  Pending p;
  p.ring = ring;
  p.group = group;
  p.op = spec.op;
  p.dtype = -1;
  p.nbytes = payload_nbytes(args[spec.input_arg], &p.dtype);
  if (!spec.payload) p.nbytes = 0;  // a barrier's tensor is no payload
  if (p.dtype < 0) p.dtype = FLS_DT_UNKNOWN;
  p.flags = spec.coalesced ? FLS_FL_COALESCED : 0;
  if (spec.async_arg >= 0 && size_t(spec.async_arg) < nargs && args[spec.async_arg].isBool() &&
      args[spec.async_arg].toBool())
    p.flags |= FLS_FL_ASYNC_OP;
  p.peer = -1;
  if (spec.peer_arg >= 0 && args[spec.peer_arg].isInt())
    p.peer = group->global_rank(args[spec.peer_arg].toInt());
  auto [token, t_start] = ring->begin();
  p.token = token;
  p.t_start = t_start;
  p.call_index = group->calls.fetch_add(1, std::memory_order_acq_rel);
  {
    std::lock_guard<std::mutex> lock(h->pause_mu);
    if (!h->pause_group.empty() && name == h->pause_group) {
      h->pause_calls.push_back({p.call_index, uint64_t(spec.op) * 1000003ULL + p.nbytes, t_start});
      if (h->pause_calls.size() > 256) h->pause_calls.pop_front();
    }
  }
  try {
    below();
  } catch (...) {
    ring->write(t_start, now_ns(), p.nbytes, group->key, p.call_index, p.op, p.dtype,
                FLS_SRC_PYTHON, p.flags | kFailed, p.peer, token);
    throw;
  }
  try {
    const c10::IValue& last = stack->back();  // (tensors, Work) or a bare Work
    c10::intrusive_ptr<c10d::Work> work;
    if (!last.isNone()) work = last.toCustomClass<c10d::Work>();
    if (!work) {  // no Work to follow: the record ends at the return (on an H200, torch 2.11's
      p.flags |= kEndIsEnqueue;  // synchronous NCCL all_reduce returned a null Work; this
      // kernel dereferenced it and the process died, issue 50)
      finish(p, now_ns(), false);
      return;
    }
    if (spec.any_source) p.work = work;
    c10::intrusive_ptr<c10::ivalue::Future> fut;
    try {
      fut = work->getFuture();
    } catch (...) {
      fut.reset();
    }
    if (!fut && spec.at_return) {  // gloo's reduce-scatter works never report completion:
      p.flags |= kEndIsEnqueue;    // the exchange is done when the call returns
      finish(p, now_ns(), false);
      return;
    }
    if (!fut) {
      p.work = work;
      h->watcher->watch(std::move(p));
      return;
    }
    auto shared = std::make_shared<Pending>(std::move(p));
    fut->addCallback([shared](c10::ivalue::Future& f) {
      int64_t t_end = now_ns();
      try {
        finish(*shared, t_end, f.hasError());
      } catch (...) {
        shared->ring->count_dropped(1);
        shared->ring->settle(shared->token);
      }
    });
  } catch (...) {  // no Work to follow: the record is lost, the call is not
    ring->count_dropped(1);
    ring->settle(token);
  }
}

// -- the Python interface ------------------------------------------------------------------

void install(py::object capture, const std::vector<py::dict>& specs,
             const std::vector<std::pair<py::object, int>>& dtypes) {
  Hook* h = hook();
  TORCH_CHECK(!h->lib, "failslow: the native hook is installed already");
  if (h->specs.empty()) {  // read by kernels without a lock: written once, at the first install
    for (const auto& [dtype, code] : dtypes) {
      TORCH_CHECK(THPDtype_Check(dtype.ptr()), "failslow: not a torch dtype in the dtype table");
      h->dtypes[static_cast<uint8_t>(reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type)] = code;
    }
    for (const py::dict& d : specs) {
      OpSpec s;
      s.op = d["op"].cast<int>();
      s.input_arg = d["input_arg"].cast<int>();
      s.payload = d["payload"].cast<bool>();
      s.pg_arg = d["pg_arg"].cast<int>();
      s.peer_arg = d["peer_arg"].cast<int>();
      s.async_arg = d["async_arg"].cast<int>();
      s.coalesced = d["coalesced"].cast<bool>();
      s.at_return = d["at_return"].cast<bool>();
      s.any_source = d["any_source"].cast<bool>();
      h->specs["c10d::" + d["name"].cast<std::string>()] = s;
    }
  }
  h->capture = capture;
  h->lib = std::make_unique<torch::Library>(torch::Library::IMPL, "c10d",
                                            c10::DispatchKey::Autograd, __FILE__, __LINE__);
  for (const auto& [qualified, spec] : h->specs)
    h->lib->impl(qualified.substr(6).c_str(), torch::CppFunction::makeFromBoxedFunction<&kernel>());
  h->active.store(true, std::memory_order_release);
}

void uninstall() {
  Hook* h = hook();
  h->active.store(false, std::memory_order_release);
  h->lib.reset();
  h->capture = py::object();
}

void open_ring(const std::string& path) {
  auto ring = std::make_shared<Ring>(path);
  Hook* h = hook();
  std::lock_guard<std::mutex> lock(h->ring_mu);
  h->ring = ring;
}

void close_ring() {
  Hook* h = hook();
  std::lock_guard<std::mutex> lock(h->ring_mu);
  h->ring.reset();  // unmapped when the last call in flight wrote its record
}

std::shared_ptr<Ring> ring_or_throw() {
  auto ring = current_ring();
  TORCH_CHECK(ring, "failslow: the native hook has no ring open");
  return ring;
}

void add_group(const std::string& name, uint64_t key, const std::vector<int32_t>& ranks,
               bool defer, uint64_t first_call) {
  Hook* h = hook();
  std::unique_lock<std::shared_mutex> lock(h->groups_mu);
  if (h->groups.count(name)) return;
  auto g = std::make_shared<Group>();
  g->key = key;
  g->ranks = ranks;
  g->defer = defer;
  g->calls.store(first_call);
  h->groups.emplace(name, std::move(g));
}

std::shared_ptr<Group> group_or_throw(const std::string& name) {
  auto g = find_group(name);
  TORCH_CHECK(g, "failslow: group ", name, " is not registered with the native hook");
  return g;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "failslow's collective hook in C++ (failslow/nccl_hook/native/hook.cpp)";
  m.def("install", &install);
  m.def("uninstall", &uninstall);
  m.def("open_ring", &open_ring);
  m.def("close_ring", &close_ring);
  m.def("add_group", &add_group);
  m.def("next_call", [](const std::string& name) {
    return group_or_throw(name)->calls.fetch_add(1, std::memory_order_acq_rel);
  });
  m.def("peek_call", [](const std::string& name) {
    return group_or_throw(name)->calls.load(std::memory_order_acquire);
  });
  m.def("begin", []() { return ring_or_throw()->begin(); });
  m.def("end", [](uint64_t token) { ring_or_throw()->settle(token); });
  m.def("write", [](int64_t t_start, int64_t t_end, uint64_t nbytes, uint64_t key,
                    uint64_t call_index, int op, int dtype, int source, int flags, int32_t peer,
                    uint64_t token) {
    return ring_or_throw()->write(t_start, t_end, nbytes, key, call_index, op, dtype, source,
                                  flags, peer, token);
  });
  m.def("count_dropped", [](uint64_t n) { ring_or_throw()->count_dropped(n); });
  m.def("set_pause_group", [](const std::string& name) {
    Hook* h = hook();
    std::lock_guard<std::mutex> lock(h->pause_mu);
    if (name != h->pause_group) h->pause_calls.clear();
    h->pause_group = name;
  });
  m.def("pause_calls", []() {
    Hook* h = hook();
    std::lock_guard<std::mutex> lock(h->pause_mu);
    std::vector<std::tuple<uint64_t, uint64_t, int64_t>> out;
    for (const PauseCall& c : h->pause_calls) out.emplace_back(c.call_index, c.token, c.t_start);
    return out;
  });
  m.def("set_busy", [](bool busy) {
    bool was = t_busy;
    t_busy = busy;
    return was;
  });
}
