#include "dist/gloo_communicator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <exception>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

#include "dist/tcp_store.h"

namespace tern {
namespace {

// out[i] = a[i] + b[i]. Gloo's ring allreduce reduces each segment of the buffer once, hop by hop along the ring,
// on the rank where the segment ends up complete, and then only copies those finished bytes to the other ranks: so
// every rank holds the same bits. Float addition is commutative bit for bit, so which operand came off the wire does
// not matter. RING is asked for by name (it is also the default) so that a change of default cannot change this.
void sum_floats(void* out, const void* a, const void* b, size_t n) {
  float* o = static_cast<float*>(out);
  const float* x = static_cast<const float*>(a);
  const float* y = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

// Gloo's TCP pairs write with writev(2): a peer gone would raise SIGPIPE and end the process.
void ignore_sigpipe() {
  struct sigaction old {};
  if (sigaction(SIGPIPE, nullptr, &old) == 0 && (old.sa_flags & SA_SIGINFO) == 0 && old.sa_handler == SIG_DFL) {
    std::signal(SIGPIPE, SIG_IGN);
  }
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const GlooOptions& options, std::unique_ptr<TcpStoreServer> server, std::unique_ptr<TcpStore> store,
                   std::shared_ptr<gloo::transport::Device> device, std::shared_ptr<gloo::rendezvous::Context> context)
      : rank_(options.rank),
        world_(options.world),
        timeout_(options.timeout),
        server_(std::move(server)),
        store_(std::move(store)),
        device_(std::move(device)),
        context_(std::move(context)) {}

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  std::string describe() const override {
    return fmt::format("gloo tcp ({}, rank {} of {}, store {})", device_->str(), rank_, world_,
                       store_->server_address());
  }

  Expected<void> all_reduce_sum(std::span<float> data) override {
    return run("all_reduce_sum", [&](uint32_t tag) {
      if (data.empty()) return;
      gloo::AllreduceOptions opts(context_);
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setOutput(data.data(), data.size());  // in place: the output is the input
      opts.setReduceFunction(sum_floats);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::allreduce(opts);
    });
  }

  Expected<void> all_gather(std::span<const float> mine, std::span<float> all) override {
    return run("all_gather", [&](uint32_t tag) {
      // Refused before any byte moves; the peers then wait for this rank, so the group is broken for them too.
      if (all.size() != mine.size() * static_cast<size_t>(world_)) {
        throw std::invalid_argument(
            fmt::format("{} elements gathered into {} (world size {})", mine.size(), all.size(), world_));
      }
      if (mine.empty()) return;
      gloo::AllgatherOptions opts(context_);
      opts.setInput(const_cast<float*>(mine.data()), mine.size());  // only read
      opts.setOutput(all.data(), all.size());
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
    });
  }

  Expected<void> broadcast(std::span<std::byte> data, int root) override {
    return run("broadcast", [&](uint32_t tag) {
      if (root < 0 || root >= world_) {
        throw std::invalid_argument(fmt::format("root {} outside world size {}", root, world_));
      }
      if (data.empty()) return;
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(reinterpret_cast<uint8_t*>(data.data()), data.size());
      opts.setRoot(root);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::broadcast(opts);
    });
  }

  Expected<void> barrier() override {
    return run("barrier", [&](uint32_t tag) {
      gloo::BarrierOptions opts(context_);
      opts.setTag(tag);
      opts.setTimeout(timeout_);
      gloo::barrier(opts);
    });
  }

 private:
  // Runs one collective under its own tag (every rank counts the same collectives, so the tags agree and a message
  // of one collective can never be taken for another's); anything Gloo throws becomes this rank's error.
  template <typename Fn>
  Expected<void> run(const char* what, Fn&& fn) {
    if (!broken_.empty()) return make_error("{} on rank {}: the communicator is broken: {}", what, rank_, broken_);
    const uint32_t tag = next_tag_++;
    try {
      fn(tag);
      return {};
    } catch (const std::exception& e) {
      return fail(what, e.what());
    } catch (...) {
      return fail(what, "an unknown exception");
    }
  }

  tl::unexpected<Error> fail(const char* what, const std::string& why) {
    if (broken_.empty()) {
      broken_ = fmt::format("{} on rank {} (gloo, world size {}): {}", what, rank_, world_, why);
      // Reset this rank's connections so its peers fail now rather than at their timeout.
      try {
        context_->closeConnections();
      } catch (...) {
      }
    }
    return make_error("{}", broken_);
  }

  const int rank_;
  const int world_;
  const std::chrono::milliseconds timeout_;
  uint32_t next_tag_ = 0;
  std::string broken_;  // non-empty once a collective failed
  // Destroyed bottom-up: the connections first, the store server (if this rank serves it) last.
  std::unique_ptr<TcpStoreServer> server_;
  std::unique_ptr<TcpStore> store_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
};

// Gloo resolves the bind host itself but misreads getaddrinfo's failures (it tests for -1), and leaks getifaddrs'
// list when an interface is not found: so both are looked up here first.
Expected<void> check_bind(const gloo::transport::tcp::attr& attr) {
  if (!attr.iface.empty()) {
    ifaddrs* list = nullptr;
    if (getifaddrs(&list) != 0)
      return make_error("cannot list the network interfaces: {}", std::system_category().message(errno));
    bool found = false;
    for (const ifaddrs* ifa = list; ifa != nullptr && !found; ifa = ifa->ifa_next) {
      found = ifa->ifa_addr != nullptr && attr.iface == ifa->ifa_name &&
              (ifa->ifa_addr->sa_family == AF_INET || ifa->ifa_addr->sa_family == AF_INET6);
    }
    freeifaddrs(list);
    if (!found) return make_error("no network interface '{}' with an IP address", attr.iface);
    return {};
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  const int rv = getaddrinfo(attr.hostname.c_str(), nullptr, &hints, &result);
  if (rv != 0) return make_error("cannot resolve the bind host '{}': {}", attr.hostname, gai_strerror(rv));
  freeaddrinfo(result);
  return {};
}

// Every rank announces itself, then waits for all the others: a rank missing is named here, before Gloo's own
// waits for addresses (which would name only a store key). The serving rank gives up at its deadline and takes the
// store with it, so a rank waiting a little longer may see the store go away instead: that is named the same way.
Expected<void> join(TcpStore& store, const GlooOptions& o, std::chrono::steady_clock::time_point deadline) {
  std::vector<std::string> keys;
  for (int r = 0; r < o.world; ++r) keys.push_back(fmt::format("{}/joined/{}", o.prefix, r));
  const std::string me = std::to_string(o.rank);
  TERN_TRY(store.set_value(keys[static_cast<size_t>(o.rank)], std::span<const char>(me.data(), me.size())));
  std::vector<int> missing;
  for (std::chrono::milliseconds backoff(1);; backoff = std::min(backoff * 2, std::chrono::milliseconds(50))) {
    auto present = store.check(keys);
    if (!present) {
      if (missing.empty()) return tl::unexpected<Error>(present.error());
      return make_error("rank(s) {} did not join before the store stopped answering: {}", fmt::join(missing, ", "),
                        present.error().message);
    }
    missing.clear();
    for (int r = 0; r < o.world; ++r) {
      if (!(*present)[static_cast<size_t>(r)]) missing.push_back(r);
    }
    if (missing.empty()) return {};
    if (std::chrono::steady_clock::now() >= deadline) {
      return make_error("rank(s) {} did not join within {} ms", fmt::join(missing, ", "), o.timeout.count());
    }
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(backoff, deadline - std::chrono::steady_clock::now()));
  }
}

}  // namespace

Expected<std::unique_ptr<Communicator>> gloo_communicator_create(const GlooOptions& o) {
  if (o.world < 1 || o.rank < 0 || o.rank >= o.world) {
    return make_error("gloo: rank {} outside world size {}", o.rank, o.world);
  }
  if (o.timeout.count() <= 0) return make_error("gloo: timeout of {} ms", o.timeout.count());
  if (o.prefix.empty() || o.prefix.size() > 1024) {
    return make_error("gloo: a store prefix of {} bytes (1 to 1024)", o.prefix.size());
  }
  ignore_sigpipe();
  // Connecting to the store and waiting for the other ranks share one deadline.
  const auto deadline = std::chrono::steady_clock::now() + o.timeout;
  std::string where =
      fmt::format("gloo rendezvous of rank {} (world size {}) at {}:{}", o.rank, o.world, o.store_host, o.store_port);

  std::unique_ptr<TcpStoreServer> server;
  int port = o.store_port;
  if (o.serve_store) {
    auto started = TcpStoreServer::start(o.store_host, o.store_port);
    if (!started) return wrap_error(started.error(), where);
    server = std::move(*started);
    port = server->port();
    where = fmt::format("gloo rendezvous of rank {} (world size {}) at {}:{}", o.rank, o.world, o.store_host, port);
    if (o.on_store_listening) o.on_store_listening(port);
  }
  auto store = TcpStore::connect(
      o.store_host, port, std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
  if (!store) return wrap_error(store.error(), where);
  // What to listen on is checked before joining: a rank that cannot listen never joins, and the others name it.
  gloo::transport::tcp::attr attr;
  if (!o.bind_iface.empty()) {
    attr.iface = o.bind_iface;
  } else {
    attr.hostname = o.bind_host.empty() ? (*store)->local_address() : o.bind_host;
  }
  if (auto ok = check_bind(attr); !ok) return wrap_error(ok.error(), where);
  if (auto joined = join(**store, o, deadline); !joined) return wrap_error(joined.error(), where);

  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::rendezvous::Context> context;
  try {
    device = gloo::transport::tcp::CreateDevice(attr);
    context = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world);
    context->setTimeout(o.timeout);
    gloo::rendezvous::PrefixStore prefixed(o.prefix, **store);
    context->connectFullMesh(prefixed, device);
  } catch (const std::exception& e) {
    return make_error("{}: {}", where, e.what());
  } catch (...) {
    return make_error("{}: an unknown exception", where);
  }
  auto comm = std::make_unique<GlooCommunicator>(o, std::move(server), std::move(*store), std::move(device),
                                                 std::move(context));
  // Once every rank is past this, none reads the store any more: the serving rank may then go first.
  if (auto met = comm->barrier(); !met) return wrap_error(met.error(), where);
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace tern
