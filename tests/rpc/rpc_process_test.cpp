// dcomm/rpc.hpp between forked processes (env://, one store on rank 0):
// strangers at the job's open port cannot call, and a callee killed by
// SIGKILL inside a handler fails its caller's call with peer_lost. Not in
// the TSan build (forks; nothing shared between ranks' threads here).
#include <doctest/doctest.h>
#include <poll.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dcomm/detail/handshake.hpp>
#include <dcomm/init_process_group.hpp>
#include <dcomm/rpc.hpp>
#include <dcomm/spawn.hpp>
#include <random>
#include <string>
#include <vector>

#include "support/comm_world.hpp"
#include "support/deadline.hpp"
#include "support/fork_world.hpp"
#include "support/listening_socket.hpp"

using namespace std::chrono_literals;
using dcomm::errc;
using dcomm::test::contains;
using dcomm::test::failure_of;
using dcomm::test::require;

namespace {

// A stranger at the store's port (rank 0's, open for the whole job: the
// only port of a job's after start-up): connects and sends `bytes`.
asio::ip::tcp::socket stranger(asio::io_context& io, const std::string& bytes) {
  asio::ip::tcp::socket s(io);
  s.connect({asio::ip::make_address(std::getenv("MASTER_ADDR")),
             static_cast<std::uint16_t>(std::stoi(std::getenv("MASTER_PORT")))});
  asio::error_code ignored;
  asio::write(s, asio::buffer(bytes), ignored);
  return s;
}

// Whether the other end closes s within `limit` (it may first send a refusal).
bool closed_by_peer(asio::ip::tcp::socket& s, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{s.native_handle(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buffer[4096];
    asio::error_code ec;
    s.read_some(asio::buffer(buffer), ec);
    if (ec) return true;  // end of file, or reset
  }
}

// The bytes of a real call of `name` with no arguments, as an agent sends it.
std::string forged_call(const std::string& name) {
  namespace wire = dcomm::rpc::wire;
  auto frame = dcomm::rpc::detail::make_frame([&](dcomm::rpc::writer& w) {
    w(name);
    w(dcomm::rpc::signature<>());
  });
  wire::header h{
      .magic = wire::magic, .type = wire::kind::call, .id = 7, .bytes = frame.payload.size()};
  std::string bytes(wire::head_bytes, '\0');  // the payload fits in the head
  std::memcpy(bytes.data(), &h, sizeof h);
  std::memcpy(bytes.data() + sizeof h, frame.payload.data(), frame.payload.size());
  return bytes;
}

}  // namespace

TEST_SUITE("rpc") {
  TEST_CASE("strangers' raw sockets cannot call: their bytes are refused, the agent serves on") {
    DCOMM_TEST_DEADLINE(90s);
    auto rank = [](int r) {
      asio::io_context context;
      int ticks = 0;
      dcomm::sync_wait(context, [&]() -> asio::awaitable<void> {
        const dcomm::init_options<dcomm::cpu_backend> o{.init_method = "env://"};
        auto comm =
            co_await dcomm::init_process_group<dcomm::cpu_backend>(context.get_executor(), o);
        dcomm::rpc::registry f;
        f.add("tick", [&ticks] { return ++ticks; });
        auto rpc = co_await dcomm::rpc::start(comm, f, {.timeout = 20s});
        if (r == 1) {
          asio::io_context io;
          std::vector<asio::ip::tcp::socket> held;
          // A call as the agent frames it, bare; then after a hello that
          // claims to be rank 0; then noise; then connect-and-close.
          held.push_back(stranger(io, forged_call("tick")));
          dcomm::detail::wire_writer hello;
          hello.raw(dcomm::detail::handshake_magic)
              .u16(dcomm::detail::protocol_version)
              .str("tcp_backend")
              .u32(0)
              .raw(std::string(32, 'n'));
          held.push_back(stranger(io, hello.bytes() + forged_call("tick")));
          std::string noise(64 << 10, '\0');
          std::mt19937 random(7);
          for (auto& ch : noise) ch = static_cast<char>(random());
          held.push_back(stranger(io, noise));
          for (int i = 0; i < 20; ++i) stranger(io, "").close();
          // The only call that runs is this rank's own.
          require(co_await rpc.call<int>(0, "tick") == 1, "a stranger's call ran");
          for (std::size_t i = 0; i < held.size(); ++i)
            require(closed_by_peer(held[i], 10s),
                    "stranger " + std::to_string(i) + " was not refused");
          require(co_await rpc.call<int>(0, "tick") == 2, "served on");
        }
        co_await rpc.shutdown();
      }());
    };
    CHECK_NOTHROW(dcomm::spawn(2, rank, {.timeout = 60s}));
  }

  TEST_CASE("a callee killed by SIGKILL mid-call: the caller gets peer_lost naming it") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::test::listening_socket master;
    auto results = dcomm::test::fork_world(2, 40s, [&](int r) {
      dcomm::test::set_rank_environment(master, r, 2);
      asio::io_context context;
      int code = 1;
      dcomm::sync_wait(context, [&]() -> asio::awaitable<void> {
        const dcomm::init_options<dcomm::cpu_backend> o{.init_method = "env://"};
        auto comm =
            co_await dcomm::init_process_group<dcomm::cpu_backend>(context.get_executor(), o);
        dcomm::rpc::registry f;
        f.add("die", [] { ::raise(SIGKILL); });
        auto rpc = co_await dcomm::rpc::start(comm, f, {.timeout = 20s});
        if (r == 1) {  // serves until it is killed
          asio::steady_timer t(context, 30s);
          co_await t.async_wait(asio::use_awaitable);
          co_return;
        }
        const auto began = std::chrono::steady_clock::now();
        auto [c, what] = co_await failure_of([&] { return rpc.call(1, "die"); });
        const bool in_time = std::chrono::steady_clock::now() - began < 10s;
        std::fprintf(stderr, "rank 0: %s\n", what.c_str());
        code =
            c == errc::peer_lost && contains(what, "rank 1") && contains(what, "'die'") && in_time
                ? 0
                : 2;
      }());
      return code;
    });
    CHECK(results[0].ok());
    CHECK(results[1].signal == SIGKILL);
  }
}
