// The store contract, run against every store, and what only tcp_store has:
// many processes, misbehaving clients, a dying server, job tokens.
// Size: many small independent cases in one translation unit on purpose: each
// Asio-heavy test file costs about a minute per CI build (three builds), so
// a component's cases share one file rather than split by line count.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dcomm/rendezvous.hpp"
#include "support/c10d_server.hpp"
#include "support/deadline.hpp"
#include "support/fork_world.hpp"
#include "support/listening_socket.hpp"
#include "support/raw_peer.hpp"
#include "support/store_world.hpp"
#include "support/text.hpp"

using namespace std::chrono_literals;
using dcomm::errc;

namespace {

// Runs fn(error) expecting a dcomm::error with `code`; returns its message.
template <typename F>
std::string expect_error(errc code, F&& fn) {
  try {
    fn();
  } catch (const dcomm::error& e) {
    CHECK_MESSAGE(e.code() == code, std::string(e.what()));
    return e.what();
  }
  FAIL("expected a dcomm::error: " << dcomm::make_error_code(code).message());
  return {};
}

// g++ 12 cannot compile a braced list inside a co_await expression, so the
// coroutines below build key lists with this.
template <typename... K>
std::vector<std::string> keys(K... k) {
  return {std::string(k)...};
}

using dcomm::test::contains;

// The contract every store keeps, exercised through one handle with
// co_await, and through a second handle on another thread.
void check_store_contract(dcomm::test::store_world& world) {
  asio::io_context ctx;
  auto s = world.handle(ctx.get_executor());

  SUBCASE("set and get, binary values, overwrite") {
    std::string binary("a\0b\xff", 4);
    dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
      co_await s->set("k", "v1");
      CHECK(co_await s->get("k") == "v1");
      co_await s->set("k", binary);
      CHECK(co_await s->get("k") == binary);
      co_await s->set("empty", "");
      CHECK(co_await s->get("empty") == "");
      std::string big(1 << 20, 'x');
      co_await s->set("big", big);
      CHECK(co_await s->get("big") == big);
    }());
  }

  SUBCASE("add counts from zero, wraps, refuses non-integers") {
    dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
      CHECK(co_await s->add("n", 5) == 5);
      CHECK(co_await s->add("n", -7) == -2);
      CHECK(co_await s->get("n") == "-2");
      CHECK(co_await s->add("n", 0) == -2);
      co_await s->set("max", std::to_string(INT64_MAX));
      CHECK(co_await s->add("max", 1) == INT64_MIN);
      co_await s->set("text", "abc");
    }());
    auto what =
        expect_error(errc::invalid_argument, [&] { dcomm::sync_wait(ctx, s->add("text", 1)); });
    CHECK(contains(what, "text"));
  }

  SUBCASE("compare_set follows c10d") {
    dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
      // Missing key, expected non-empty: nothing set, expected returned.
      CHECK(co_await s->compare_set("c", "x", "y") == "x");
      CHECK_FALSE(co_await s->check(keys("c")));
      // Missing key, expected empty: set.
      CHECK(co_await s->compare_set("c", "", "first") == "first");
      // Match: replaced.
      CHECK(co_await s->compare_set("c", "first", "second") == "second");
      // Mismatch: current value returned, unchanged.
      CHECK(co_await s->compare_set("c", "nope", "third") == "second");
      CHECK(co_await s->get("c") == "second");
    }());
  }

  SUBCASE("check, delete_key, num_keys") {
    dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
      auto before = co_await s->num_keys();
      co_await s->set("a", "1");
      co_await s->set("b", "2");
      CHECK(co_await s->num_keys() == before + 2);
      CHECK(co_await s->check(keys("a", "b")));
      CHECK_FALSE(co_await s->check(keys("a", "zz")));
      CHECK(co_await s->delete_key("a"));
      CHECK_FALSE(co_await s->delete_key("a"));
      CHECK_FALSE(co_await s->check(keys("a")));
      CHECK(co_await s->num_keys() == before + 1);
    }());
  }

  SUBCASE("wait and get time out naming only the missing keys") {
    dcomm::sync_wait(ctx, s->set("present", "1"));
    auto what = expect_error(errc::timeout, [&] {
      dcomm::sync_wait(ctx, s->wait({"present", "absent1", "absent2"}, 100ms));
    });
    CHECK(contains(what, "absent1"));
    CHECK(contains(what, "absent2"));
    CHECK_FALSE(contains(what, "present"));
    what = expect_error(errc::timeout, [&] { dcomm::sync_wait(ctx, s->get("never", 50ms)); });
    CHECK(contains(what, "never"));
  }

  SUBCASE("a set from another thread wakes wait and get") {
    std::jthread other([&] {
      asio::io_context other_ctx;
      auto t = world.handle(other_ctx.get_executor());
      std::this_thread::sleep_for(50ms);
      dcomm::sync_wait(other_ctx, t->set("late", "here"));
      dcomm::sync_wait(other_ctx, t->set("later", "too"));
    });
    dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
      CHECK(co_await s->get("late", 10s) == "here");
      co_await s->wait(keys("late", "later"), 10s);
    }());
    other.join();
  }

  SUBCASE("a get waiting on a handle does not hold up a set on the same handle") {
    dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
      auto waiting = asio::co_spawn(ctx, s->get("same", 10s), asio::use_awaitable);
      co_await s->set("same", "handle");
      CHECK(co_await std::move(waiting) == "handle");
    }());
  }

  SUBCASE("blocking, callback and future forms") {
    dcomm::detail::io_thread thread;
    auto b = world.handle(thread.get_executor());
    b->set("form", "blocking", dcomm::blocking);
    CHECK(b->get("form", dcomm::blocking) == "blocking");
    CHECK(b->add("forms", 2, dcomm::blocking) == 2);
    std::promise<std::string> got;
    b->get("form", [&](std::exception_ptr e, std::string v) {
      if (e)
        got.set_exception(e);
      else
        got.set_value(std::move(v));
    });
    CHECK(got.get_future().get() == "blocking");
    CHECK(b->check(std::vector<std::string>{"form"}, asio::use_future).get());
    // A blocking call from the thread that runs the store's executor could
    // never finish: refused, not hung.
    std::promise<std::string> refused;
    asio::post(thread.get_executor(), [&] {
      try {
        b->get("form", dcomm::blocking);
        refused.set_value("not refused");
      } catch (const dcomm::error& e) {
        refused.set_value(e.what());
      }
    });
    CHECK(contains(refused.get_future().get(), "blocking call"));
  }
}

// Three ranks start as torchrun's workers do when its agent serves the
// store (TORCHELASTIC_USE_AGENT_STORE=True, restart 2): they join it,
// under "/worker/attempt_2/", and leave; the agent's Python side sees
// their keys there.
void check_agent_store_rendezvous(dcomm::test::c10d_server& agent) {
  const int world = 3;
  std::vector<std::future<int>> ranks;
  for (int rank = 0; rank < world; ++rank)
    ranks.push_back(std::async(std::launch::async, [&agent, rank] {
      const dcomm::env_lookup env = [&agent,
                                     rank](std::string_view name) -> std::optional<std::string> {
        if (name == "TORCHELASTIC_USE_AGENT_STORE") return "True";
        if (name == "TORCHELASTIC_RESTART_COUNT") return "2";
        if (name == "MASTER_ADDR") return "127.0.0.1";
        if (name == "MASTER_PORT") return std::to_string(agent.port);
        if (name == "RANK") return std::to_string(rank);
        if (name == "WORLD_SIZE") return "3";
        return std::nullopt;
      };
      auto joined = dcomm::rendezvous({.timeout = 30s, .env = &env});
      CHECK(dynamic_cast<dcomm::c10d_store*>(joined.store.get()) != nullptr);
      joined.store->add("sum", rank + 1, dcomm::blocking);
      dcomm::depart(joined, dcomm::blocking);
      return joined.rank;
    }));
  for (int rank = 0; rank < world; ++rank)
    CHECK(ranks[static_cast<std::size_t>(rank)].get() == rank);
  CHECK(agent.command("get /worker/attempt_2/sum") == "6");
  CHECK(agent.command("get /worker/attempt_2/dcomm/rdzv/world_size") == "3");
}

}  // namespace

TEST_SUITE("hash_store") {
  TEST_CASE("hash_store keeps the store contract") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::test::hash_world world;
    check_store_contract(world);
  }
}

TEST_SUITE("prefix_store") {
  TEST_CASE("prefix_store keeps the store contract") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::test::prefix_world world;
    check_store_contract(world);
  }

  TEST_CASE("prefix_store namespaces keys in the inner store") {
    DCOMM_TEST_DEADLINE(30s);
    asio::io_context ctx;
    auto inner = dcomm::hash_store::create(ctx.get_executor());
    auto a = dcomm::prefix_store::create("a", inner);
    auto b = dcomm::prefix_store::create("b", inner);
    dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
      co_await a->set("k", "from a");
      co_await b->set("k", "from b");
      CHECK(co_await a->get("k") == "from a");
      CHECK(co_await inner->get("b/k") == "from b");
      CHECK_FALSE(co_await a->check(keys("b/k")));
    }());
    auto what =
        expect_error(errc::timeout, [&] { dcomm::sync_wait(ctx, a->get("missing", 20ms)); });
    CHECK(contains(what, "a/missing"));
  }
}

TEST_SUITE("file_store contract") {
  TEST_CASE("file_store keeps the store contract") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::test::file_world world;
    check_store_contract(world);
  }
}

TEST_SUITE("tcp_store") {
  TEST_CASE("tcp_store keeps the store contract over IPv4") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::test::tcp_world world("127.0.0.1");
    check_store_contract(world);
  }

  TEST_CASE("tcp_store keeps the store contract over IPv6") {
    DCOMM_TEST_DEADLINE(60s);
    asio::io_context probe;
    asio::ip::tcp::acceptor acceptor(probe);
    asio::error_code ec;
    acceptor.open(asio::ip::tcp::v6(), ec);
    if (!ec) acceptor.bind({asio::ip::make_address("::1"), 0}, ec);
    if (ec) {
      MESSAGE("skipped: no IPv6 loopback here (" << ec.message() << ")");
      return;
    }
    acceptor.close();
    dcomm::test::tcp_world world("::1");
    asio::io_context ctx;
    auto s = world.handle(ctx.get_executor());
    CHECK(contains(s->address(), "tcp://[::1]:"));
    check_store_contract(world);
  }

  TEST_CASE("server picks a port, reports it, and a taken port is named") {
    DCOMM_TEST_DEADLINE(30s);
    asio::io_context ctx;
    auto server =
        dcomm::tcp_store_server::start(ctx.get_executor(), {.bind_host = "127.0.0.1", .port = 0});
    CHECK(server->port() != 0);
    CHECK(server->address() == "tcp://127.0.0.1:" + std::to_string(server->port()));
    auto what = expect_error(errc::address_in_use, [&] {
      dcomm::tcp_store_server::start(ctx.get_executor(),
                                     {.bind_host = "127.0.0.1", .port = server->port()});
    });
    CHECK(contains(what, std::to_string(server->port())));
    CHECK(contains(what, "MASTER_PORT"));
  }

  TEST_CASE("a client started before the server retries until it is up") {
    DCOMM_TEST_DEADLINE(30s);
    // Start the server late, on a port nothing listens on yet.
    auto port = dcomm::test::free_port();
    dcomm::detail::io_thread server_thread;
    std::unique_ptr<dcomm::tcp_store_server> server;
    std::jthread starter([&] {
      std::this_thread::sleep_for(200ms);
      server = dcomm::tcp_store_server::start(server_thread.get_executor(),
                                              {.bind_host = "127.0.0.1", .port = port});
    });
    asio::io_context ctx;
    auto s = dcomm::tcp_store::create(ctx.get_executor(),
                                      {.host = "127.0.0.1", .port = port, .timeout = 10s});
    dcomm::sync_wait(ctx, s->set("k", "v"));
    CHECK(dcomm::sync_wait(ctx, s->get("k")) == "v");
    starter.join();
  }

  TEST_CASE("connecting to nothing fails at the deadline naming the address") {
    DCOMM_TEST_DEADLINE(30s);
    auto port = dcomm::test::free_port();
    asio::io_context ctx;
    auto s = dcomm::tcp_store::create(ctx.get_executor(),
                                      {.host = "127.0.0.1", .port = port, .timeout = 300ms});
    auto what = expect_error(errc::connect_failed, [&] { dcomm::sync_wait(ctx, s->connect()); });
    CHECK(contains(what, "127.0.0.1:" + std::to_string(port)));
  }

  TEST_CASE("garbage, oversized and malformed frames drop only that client") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::detail::io_thread server_thread;
    auto server = dcomm::tcp_store_server::start(
        server_thread.get_executor(),
        {.bind_host = "127.0.0.1", .max_frame_bytes = 1 << 16, .handshake_timeout = 500ms});
    asio::io_context ctx;
    auto good =
        dcomm::tcp_store::create(ctx.get_executor(), {.host = "127.0.0.1", .port = server->port()});
    dcomm::sync_wait(ctx, good->set("before", "1"));

    using asio::ip::tcp;
    auto raw = [&] {
      tcp::socket sock(ctx);
      sock.connect({asio::ip::make_address("127.0.0.1"), server->port()});
      return sock;
    };
    // Reads until the server closes the connection; true if it did.
    auto closed_by_server = [](tcp::socket& sock) {
      std::array<char, 256> buf{};
      asio::error_code ec;
      for (int i = 0; i < 100 && !ec; ++i) sock.read_some(asio::buffer(buf), ec);
      return ec == asio::error::eof || ec == asio::error::connection_reset;
    };
    // A handshake as a store client would send it, for the frame tests.
    auto handshaken = [&] {
      auto sock = raw();
      asio::io_context hctx;
      tcp::socket moved(hctx, tcp::v4(), sock.release());
      dcomm::detail::handshake_config config{.purpose = "store"};
      dcomm::sync_wait(hctx, dcomm::detail::client_handshake(
                                 moved, config, "test", std::chrono::steady_clock::now() + 5s));
      return tcp::socket(ctx, tcp::v4(), moved.release());
    };

    SUBCASE("random bytes instead of a handshake") {
      auto sock = raw();
      std::string junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
      asio::write(sock, asio::buffer(junk));
      CHECK(closed_by_server(sock));
    }
    SUBCASE("silence: dropped after the handshake timeout") {
      auto sock = raw();
      CHECK(closed_by_server(sock));
    }
    SUBCASE("a frame over the size limit") {
      auto sock = handshaken();
      dcomm::detail::wire_writer w;
      w.u32(1u << 30);
      asio::write(sock, asio::buffer(w.bytes()));
      CHECK(closed_by_server(sock));
    }
    SUBCASE("a truncated request body") {
      auto sock = handshaken();
      dcomm::detail::wire_writer body;
      body.u64(1).u8(1).u32(1000).raw("short");  // set with a key longer than the frame
      dcomm::detail::wire_writer frame;
      frame.u32(static_cast<std::uint32_t>(body.bytes().size())).raw(body.bytes());
      asio::write(sock, asio::buffer(frame.bytes()));
      CHECK(closed_by_server(sock));
    }
    SUBCASE("an unknown operation") {
      auto sock = handshaken();
      dcomm::detail::wire_writer body;
      body.u64(1).u8(200);
      dcomm::detail::wire_writer frame;
      frame.u32(static_cast<std::uint32_t>(body.bytes().size())).raw(body.bytes());
      asio::write(sock, asio::buffer(frame.bytes()));
      CHECK(closed_by_server(sock));
    }
    // The server and the well-behaved client carry on.
    dcomm::sync_wait(ctx, good->set("after", "2"));
    CHECK(dcomm::sync_wait(ctx, good->get("before")) == "1");
    auto fresh =
        dcomm::tcp_store::create(ctx.get_executor(), {.host = "127.0.0.1", .port = server->port()});
    CHECK(dcomm::sync_wait(ctx, fresh->get("after")) == "2");
  }

  TEST_CASE("a frame cut short is dropped at frame_timeout; idle connections are not") {
    DCOMM_TEST_DEADLINE(60s);
    using dcomm::test::closed_within;
    using dcomm::test::raw_client;
    dcomm::test::stderr_capture log;
    dcomm::detail::io_thread server_thread;
    auto server = dcomm::tcp_store_server::start(
        server_thread.get_executor(), {.bind_host = "127.0.0.1", .frame_timeout = 300ms});
    asio::io_context ctx;
    auto good = dcomm::tcp_store::create(
        ctx.get_executor(), {.host = "127.0.0.1", .port = server->port(), .frame_timeout = 300ms});
    dcomm::sync_wait(ctx, good->set("before", "1"));

    raw_client idle(server->port());
    raw_client cut(server->port());
    raw_client half_header(server->port());
    cut.send(dcomm::test::frame(std::string(500, 'x'), 1000));  // promises 1000 bytes
    half_header.send(std::string("\x10\x00", 2));
    // Without a deadline on frames these stay open for ever.
    CHECK(closed_within(cut.socket, 10s));
    CHECK(closed_within(half_header.socket, 10s));
    // Idle time between frames is the client's own, however long.
    CHECK_FALSE(closed_within(idle.socket, 1s));
    dcomm::detail::wire_writer no_args;
    idle.send(dcomm::test::frame(
        dcomm::test::request(7, dcomm::store_detail::store_op::num_keys, std::move(no_args))));
    CHECK(dcomm::test::read_frame(idle.socket).size() == 8 + 1 + 8);
    // The store client, idle as long, carries on too.
    dcomm::sync_wait(ctx, good->set("after", "2"));
    CHECK(dcomm::sync_wait(ctx, good->get("before")) == "1");
    auto text = log.text();
    CHECK_MESSAGE(contains(text, cut.address() + ": dcomm: timed out"), text);
    CHECK(contains(text, "a frame of 1000 bytes began but did not complete within frame_timeout"));
    CHECK(contains(text, half_header.address() + ": dcomm: timed out"));
    CHECK_FALSE(contains(text, idle.address()));
  }

  TEST_CASE("a server that stops in the middle of a reply fails pending operations promptly") {
    DCOMM_TEST_DEADLINE(60s);
    using asio::ip::tcp;
    asio::io_context server_ctx;
    tcp::acceptor acceptor(server_ctx, {asio::ip::make_address("127.0.0.1"), 0});
    std::jthread fake([&] {
      auto sock = acceptor.accept();
      dcomm::test::accept_handshake(server_ctx, sock);
      auto request = dcomm::test::read_frame(sock);
      // A get's reply: id, ok, a value of 100 bytes; 20 of them come.
      dcomm::detail::wire_writer reply;
      reply.raw(request.substr(0, 8)).u8(0).u32(100).raw(std::string(20, 'v'));
      asio::write(sock, asio::buffer(dcomm::test::frame(reply.bytes(), 8 + 1 + 4 + 100)));
      dcomm::test::closed_within(sock, 15s);  // until the client gives up
    });
    asio::io_context ctx;
    auto s = dcomm::tcp_store::create(ctx.get_executor(), {.host = "127.0.0.1",
                                                           .port = acceptor.local_endpoint().port(),
                                                           .timeout = 20s,
                                                           .frame_timeout = 300ms});
    auto start = std::chrono::steady_clock::now();
    auto what = expect_error(errc::timeout, [&] { dcomm::sync_wait(ctx, s->get("k", 20s)); });
    // Not at the get's own deadline (20 s, plus the grace for the answer).
    CHECK(std::chrono::steady_clock::now() - start < 10s);
    CHECK(contains(what, "frame_timeout"));
    CHECK(contains(what, s->address()));
    // Later operations fail at once, with the same cause.
    what = expect_error(errc::timeout, [&] { dcomm::sync_wait(ctx, s->set("k", "v")); });
    CHECK(contains(what, "frame_timeout"));
    fake.join();
  }

  TEST_CASE("frames in flight stay within max_buffered_bytes") {
    DCOMM_TEST_DEADLINE(60s);
    using dcomm::test::closed_within;
    using dcomm::test::raw_client;
    dcomm::test::stderr_capture log;
    dcomm::detail::io_thread server_thread;
    auto server = dcomm::tcp_store_server::start(
        server_thread.get_executor(),
        {.bind_host = "127.0.0.1", .max_frame_bytes = 8 << 20, .max_buffered_bytes = 7 << 20});
    asio::io_context ctx;
    auto good = dcomm::tcp_store::create(
        ctx.get_executor(),
        {.host = "127.0.0.1", .port = server->port(), .max_frame_bytes = 8 << 20});
    dcomm::sync_wait(ctx, good->set("before", "1"));
    // Polls the log: the server logs a drop before it closes the socket.
    auto logged = [&](const std::string& part) {
      for (int i = 0; i < 400; ++i) {
        if (contains(log.text(), part)) return true;
        std::this_thread::sleep_for(25ms);
      }
      return false;
    };

    SUBCASE("bodies being received") {
      // Two clients each send 3 MiB of a 4 MiB set. A body's buffer doubles
      // as its bytes arrive, so holding both would take 8 MiB: one of them
      // is refused, and the other's set goes through.
      const std::size_t size = 4 << 20, part = 3 << 20;
      auto set_frame = [&](const std::string& key) {
        dcomm::detail::wire_writer args;
        args.str(key).str(std::string(size - 8 - 1 - 4 - key.size() - 4, 'v'));
        return dcomm::test::frame(
            dcomm::test::request(1, dcomm::store_detail::store_op::set, std::move(args)));
      };
      raw_client a(server->port()), b(server->port());
      std::string frame_a = set_frame("a"), frame_b = set_frame("b");
      a.send(frame_a.substr(0, part));
      b.send(frame_b.substr(0, part));
      REQUIRE(logged("max_buffered_bytes"));
      bool a_dropped = contains(log.text(), a.address() + ": ");
      auto& dropped = a_dropped ? a : b;
      auto& kept = a_dropped ? b : a;
      CHECK(closed_within(dropped.socket, 10s));
      kept.send((a_dropped ? frame_b : frame_a).substr(part));
      auto value = dcomm::sync_wait(ctx, good->get(a_dropped ? "b" : "a", 10s));
      CHECK(value.size() == size - 8 - 1 - 4 - 1 - 4);
      CHECK_FALSE(contains(log.text(), kept.address()));
      CHECK_MESSAGE(contains(log.text(), "(7340032) for frames in flight; refused"), log.text());
    }

    SUBCASE("replies a client does not read") {
      std::string big(1 << 20, 'b');
      dcomm::sync_wait(ctx, good->set("big", big));
      raw_client greedy(server->port());
      std::string requests;
      for (std::uint64_t id = 1; id <= 64; ++id) {
        dcomm::detail::wire_writer args;
        args.strs(keys("big")).u64(10000);
        requests += dcomm::test::frame(
            dcomm::test::request(id, dcomm::store_detail::store_op::get, std::move(args)));
      }
      greedy.send(requests);  // 64 MiB of replies, never read
      REQUIRE(logged(greedy.address() + ": "));
      CHECK(contains(log.text(), "a reply of 1048589 bytes needs"));
      CHECK(closed_within(greedy.socket, 10s));
      CHECK(dcomm::sync_wait(ctx, good->get("big")) == big);
    }
    dcomm::sync_wait(ctx, good->set("after", "2"));
    CHECK(dcomm::sync_wait(ctx, good->get("before")) == "1");
  }

  TEST_CASE("what a user sees is a dcomm::error with context") {
    DCOMM_TEST_DEADLINE(60s);
    using asio::ip::tcp;
    asio::io_context ctx;

    SUBCASE("a server that drops the connection during the handshake") {
      asio::io_context server_ctx;
      tcp::acceptor acceptor(server_ctx, {asio::ip::make_address("127.0.0.1"), 0});
      std::jthread fake([&] {
        auto sock = acceptor.accept();
        std::array<char, 4> hello{};
        asio::read(sock, asio::buffer(hello));
      });
      auto s = dcomm::tcp_store::create(
          ctx.get_executor(),
          {.host = "127.0.0.1", .port = acceptor.local_endpoint().port(), .timeout = 10s});
      // Not the std::system_error the socket reports.
      auto what = expect_error(errc::peer_lost, [&] { dcomm::sync_wait(ctx, s->connect()); });
      CHECK(contains(what, "handshake"));
      CHECK(contains(what, s->address()));
    }

    SUBCASE("a reply that does not decode") {
      asio::io_context server_ctx;
      tcp::acceptor acceptor(server_ctx, {asio::ip::make_address("127.0.0.1"), 0});
      std::jthread fake([&] {
        auto sock = acceptor.accept();
        dcomm::test::accept_handshake(server_ctx, sock);
        auto request = dcomm::test::read_frame(sock);
        dcomm::detail::wire_writer reply;  // ok, but no value
        reply.raw(request.substr(0, 8)).u8(0);
        asio::write(sock, asio::buffer(dcomm::test::frame(reply.bytes())));
      });  // and closes: the reply still counts
      auto s = dcomm::tcp_store::create(
          ctx.get_executor(),
          {.host = "127.0.0.1", .port = acceptor.local_endpoint().port(), .timeout = 10s});
      auto what =
          expect_error(errc::protocol_error, [&] { dcomm::sync_wait(ctx, s->get("k", 10s)); });
      CHECK(contains(what, "bad reply"));
      CHECK(contains(what, "key 'k'"));
      CHECK(contains(what, s->address()));
    }

    SUBCASE("a request over max_frame_bytes is refused before it is sent") {
      dcomm::detail::io_thread server_thread;
      auto server = dcomm::tcp_store_server::start(
          server_thread.get_executor(), {.bind_host = "127.0.0.1", .max_frame_bytes = 1 << 20});
      auto s = dcomm::tcp_store::create(
          ctx.get_executor(),
          {.host = "127.0.0.1", .port = server->port(), .max_frame_bytes = 1 << 20});
      auto what = expect_error(errc::invalid_argument, [&] {
        dcomm::sync_wait(ctx, s->set("huge", std::string(2 << 20, 'h')));
      });
      CHECK(contains(what, "max_frame_bytes"));
      CHECK(contains(what, "key 'huge'"));
      // The connection was not given up for it.
      dcomm::sync_wait(ctx, s->set("small", "fine"));
      CHECK(dcomm::sync_wait(ctx, s->get("small")) == "fine");
    }

    SUBCASE("a listen_fd that does not listen") {
      asio::io_context other;  // registered with ctx, the fd could not be adopted at all
      tcp::acceptor bound(other);
      bound.open(tcp::v4());
      bound.bind({asio::ip::make_address("127.0.0.1"), 0});
      auto what = expect_error(errc::invalid_argument, [&] {
        dcomm::tcp_store_server::start(ctx.get_executor(), {.listen_fd = bound.native_handle()});
      });
      CHECK(contains(what, "not a listening TCP socket"));
    }
  }
}

TEST_SUITE("tcp_store processes") {
  // A listening socket made before fork: rank 0 adopts it, so every process
  // knows the port without racing for it.
  using dcomm::test::listening_socket;

  // Rank 0 hosts the server, so it leaves last: the others say goodbye
  // (each set is acknowledged before they exit) and rank 0 waits for all.
  void depart(dcomm::store & s, int rank, int n) {
    if (rank != 0) {
      s.set("departed/" + std::to_string(rank), "1", dcomm::blocking);
      return;
    }
    std::vector<std::string> all;
    for (int r = 1; r < n; ++r) all.push_back("departed/" + std::to_string(r));
    s.wait(all, dcomm::blocking);
  }

  dcomm::tcp_store_options options_for(int rank, listening_socket& ls) {
    return {.host = "127.0.0.1",
            .port = ls.port,
            .is_server = rank == 0,
            .listen_fd = rank == 0 ? ls.fd() : -1,
            .timeout = 30s,
            .rank = rank};
  }

  TEST_CASE("8 processes x 1000 add end at exactly 8000") {
    DCOMM_TEST_DEADLINE(120s);
    constexpr int n = 8;
    listening_socket ls;
    auto results = dcomm::test::fork_world(n, 100s, [&](int rank) {
      auto s = dcomm::tcp_store::create(options_for(rank, ls));
      for (int i = 0; i < 1000; ++i) s->add("counter", 1, dcomm::blocking);
      s->add("finished", 1, dcomm::blocking);
      // Everyone reads the total once all have finished.
      while (std::stoi(s->get("finished", dcomm::blocking)) < n) std::this_thread::sleep_for(1ms);
      auto total = s->get("counter", dcomm::blocking);
      depart(*s, rank, n);
      return total == "8000" ? 0 : 2;
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), dcomm::test::describe(results));
  }

  TEST_CASE("compare_set race: exactly one process wins") {
    DCOMM_TEST_DEADLINE(60s);
    constexpr int n = 8;
    listening_socket ls;
    auto results = dcomm::test::fork_world(n, 50s, [&](int rank) {
      auto s = dcomm::tcp_store::create(options_for(rank, ls));
      s->add("ready", 1, dcomm::blocking);
      // Start together, so the claims really race.
      while (std::stoi(s->get("ready", dcomm::blocking)) < n) std::this_thread::sleep_for(1ms);
      auto mine = std::to_string(rank);
      auto winner = s->compare_set("leader", "", mine, dcomm::blocking);
      if (winner == mine) s->add("winners", 1, dcomm::blocking);
      s->add("done", 1, dcomm::blocking);
      while (std::stoi(s->get("done", dcomm::blocking)) < n) std::this_thread::sleep_for(1ms);
      // Exactly one winner, and everyone saw the same one.
      bool ok =
          s->get("winners", dcomm::blocking) == "1" && s->get("leader", dcomm::blocking) == winner;
      depart(*s, rank, n);
      return ok ? 0 : 3;
    });
    for (const auto& r : results) CHECK_MESSAGE(r.ok(), dcomm::test::describe(results));
  }

  // Forks happen before any thread starts in this process: a thread that
  // holds an allocator lock at fork time (AddressSanitizer's is not
  // fork-safe) would leave the child deadlocked.

  TEST_CASE("a client killed mid-request leaves the server serving the others") {
    DCOMM_TEST_DEADLINE(60s);
    listening_socket ls;
    // Rank 0 serves; rank 1 dies while its get waits on the server; rank 2
    // dies halfway through writing a frame; then rank 0 checks it still
    // serves a client of its own.
    auto results = dcomm::test::fork_world(3, 40s, [&](int rank) {
      if (rank == 0) {
        asio::io_context ctx;
        auto server = dcomm::tcp_store_server::start(ctx.get_executor(), {.listen_fd = ls.fd()});
        auto s =
            dcomm::tcp_store::create(ctx.get_executor(), {.host = "127.0.0.1", .port = ls.port});
        // Until both misbehaving clients are gone (their keys say they
        // reached the point of no return), then a little longer.
        dcomm::sync_wait(ctx, s->wait(keys("dying/1", "dying/2"), 20s));
        asio::steady_timer t(ctx, 300ms);
        dcomm::sync_wait(ctx, t.async_wait(asio::use_awaitable));
        dcomm::sync_wait(ctx, s->set("alive", "yes"));
        return dcomm::sync_wait(ctx, s->get("alive")) == "yes" ? 0 : 6;
      }
      asio::io_context ctx;
      auto s = dcomm::tcp_store::create(ctx.get_executor(),
                                        {.host = "127.0.0.1", .port = ls.port, .timeout = 20s});
      if (rank == 1) {
        asio::co_spawn(ctx, s->get("never set"), asio::detached);
        dcomm::sync_wait(ctx, [&]() -> asio::awaitable<void> {
          co_await s->set("dying/1", "1");
          // The get is queued on the same connection; let it reach the server.
          asio::steady_timer t(co_await asio::this_coro::executor, 100ms);
          co_await t.async_wait(asio::use_awaitable);
        }());
        ::kill(::getpid(), SIGKILL);
      }
      asio::ip::tcp::socket sock(ctx);
      sock.connect({asio::ip::make_address("127.0.0.1"), ls.port});
      dcomm::detail::handshake_config config{.purpose = "store"};
      dcomm::sync_wait(ctx, dcomm::detail::client_handshake(
                                sock, config, "test", std::chrono::steady_clock::now() + 10s));
      dcomm::detail::wire_writer w;
      w.u32(100).u64(7).u8(1);  // promises 100 bytes, sends 9
      asio::write(sock, asio::buffer(w.bytes()));
      dcomm::sync_wait(ctx, s->set("dying/2", "1"));
      ::kill(::getpid(), SIGKILL);
      return 0;
    });
    CHECK_MESSAGE(results[0].ok(), dcomm::test::describe(results));
    CHECK(results[1].signal == SIGKILL);
    CHECK(results[2].signal == SIGKILL);
  }

  TEST_CASE("a dying server fails pending operations with peer_lost, promptly") {
    DCOMM_TEST_DEADLINE(60s);
    listening_socket ls;
    std::fflush(nullptr);
    pid_t server = ::fork();  // before the client thread exists
    if (server == 0) {
      asio::io_context ctx;
      auto srv = dcomm::tcp_store_server::start(ctx.get_executor(), {.listen_fd = ls.fd()});
      auto s = dcomm::tcp_store::create(ctx.get_executor(), {.host = "127.0.0.1", .port = ls.port});
      try {
        dcomm::sync_wait(ctx, s->get("up", 10s));
        // Let the client's get reach the server, then die without a goodbye.
        asio::steady_timer t(ctx, 200ms);
        dcomm::sync_wait(ctx, t.async_wait(asio::use_awaitable));
      } catch (...) {
      }
      ::kill(::getpid(), SIGKILL);
    }
    REQUIRE(server > 0);
    ls.acceptor.close();
    std::string message;
    bool failed_as_expected = false;
    {
      asio::io_context ctx;
      auto s = dcomm::tcp_store::create(ctx.get_executor(),
                                        {.host = "127.0.0.1", .port = ls.port, .timeout = 10s});
      try {
        dcomm::sync_wait(ctx, s->set("up", "1"));
        // Waits far longer than the test's limit unless peer loss ends it.
        dcomm::sync_wait(ctx, s->get("never set", std::chrono::minutes(10)));
      } catch (const dcomm::error& e) {
        failed_as_expected = e.code() == errc::peer_lost;
        message = e.what();
      }
    }
    int status = 0;
    ::waitpid(server, &status, 0);
    CHECK(WIFSIGNALED(status));
    CHECK_MESSAGE(failed_as_expected, message);
    CHECK(contains(message, "127.0.0.1:" + std::to_string(ls.port)));
  }

  TEST_CASE("closing a stream under a write in flight frees each frame once") {
    DCOMM_TEST_DEADLINE(60s);
    // In a child: freeing twice aborts the process (or ASan reports it).
    auto results = dcomm::test::fork_world(1, 30s, [](int) {
      using asio::ip::tcp;
      asio::io_context ctx;
      tcp::acceptor acceptor(ctx, {asio::ip::make_address("127.0.0.1"), 0});
      for (int frames = 1; frames <= 3; ++frames) {
        tcp::socket near(ctx);
        near.connect(acceptor.local_endpoint());
        auto far = acceptor.accept();
        auto stream = std::make_shared<dcomm::store_detail::frame_stream>(
            std::move(near), dcomm::store_detail::frame_limits{});
        asio::post(ctx, [&] {
          // The first write completes at once (the socket has room), and
          // its completion waits in the queue behind this handler, which
          // closes the stream: what a reader seeing the server's goodbye,
          // the destructor, and the server's stop() all do.
          for (int i = 0; i < frames; ++i) stream->send_frame("frame " + std::to_string(i));
          stream->close();
        });
        ctx.restart();
        ctx.run();
      }
      return 0;
    });
    CHECK_MESSAGE(results[0].ok(), dcomm::test::describe(results));
  }

  TEST_CASE("a server that answers, then closes under requests being written, crashes no client") {
    DCOMM_TEST_DEADLINE(120s);
    // What rank 0's store does as it exits: it answers the requests it has
    // read and closes, while a client is still writing more. The client's
    // writes keep completing (the fake server still drains them), so one is
    // always in flight when the client reads the end of the stream.
    constexpr int rounds = 12, requests = 512, answered = 8;
    int failed = 0;
    for (int round = 0; round < rounds; ++round) {
      listening_socket ls;
      auto results = dcomm::test::fork_world(2, 30s, [&](int rank) {
        if (rank == 0) {
          auto sock = ls.acceptor.accept();
          dcomm::test::accept_handshake(ls.ctx, sock);
          for (int i = 0; i < answered; ++i) {
            auto request = dcomm::test::read_frame(sock);
            dcomm::detail::wire_writer reply;
            reply.raw(request.substr(0, 8)).u8(0);
            asio::write(sock, asio::buffer(dcomm::test::frame(reply.bytes())));
          }
          sock.shutdown(asio::ip::tcp::socket::shutdown_send);
          dcomm::test::closed_within(sock, 20s);
          return 0;
        }
        asio::io_context ctx;
        auto s = dcomm::tcp_store::create(ctx.get_executor(),
                                          {.host = "127.0.0.1", .port = ls.port, .timeout = 20s});
        int finished = 0, succeeded = 0, not_dcomm = 0;
        for (int i = 0; i < requests; ++i)
          s->set("k" + std::to_string(i), std::string(4 << 10, 'v'), [&](std::exception_ptr e) {
            ++finished;
            try {
              if (e) std::rethrow_exception(e);
              ++succeeded;
            } catch (const dcomm::error&) {
            } catch (...) {
              ++not_dcomm;
            }
          });
        ctx.run();
        // The answered ones succeed, though the end of the stream follows
        // their replies at once; the others fail with a dcomm::error.
        if (finished != requests || not_dcomm != 0) return 2;
        return succeeded == answered ? 0 : 3;
      });
      if (!results[1].ok()) {
        ++failed;
        MESSAGE("round " << round << ": " << dcomm::test::describe(results));
      }
    }
    CHECK(failed == 0);
  }

  TEST_CASE("frames announced but not sent take no memory in the server") {
    DCOMM_TEST_DEADLINE(120s);
    listening_socket ls;
    std::fflush(nullptr);
    pid_t server = ::fork();  // before any thread exists here
    if (server == 0) {
      asio::io_context ctx;
      auto srv = dcomm::tcp_store_server::start(ctx.get_executor(), {.listen_fd = ls.fd()});
      ctx.run();
      std::_Exit(0);
    }
    REQUIRE(server > 0);
    ls.acceptor.close();
    long before = 0, peak = 0;
    std::string during;
    {
      asio::io_context ctx;
      auto good = dcomm::tcp_store::create(ctx.get_executor(),
                                           {.host = "127.0.0.1", .port = ls.port, .timeout = 20s});
      dcomm::sync_wait(ctx, good->set("warm", "1"));
      before = dcomm::test::resident_kib(server);
      // Six clients announce frames of 64 MiB (the default limit) and send
      // 1 MiB of each.
      std::vector<std::unique_ptr<dcomm::test::raw_client>> clients;
      for (int i = 0; i < 6; ++i) {
        clients.push_back(std::make_unique<dcomm::test::raw_client>(ls.port));
        clients.back()->send(dcomm::test::frame(std::string(1 << 20, 'x'), 64u << 20));
      }
      // The server keeps serving meanwhile.
      dcomm::sync_wait(ctx, good->set("during", "2"));
      during = dcomm::sync_wait(ctx, good->get("during"));
      peak = before;
      for (int i = 0; i < 20; ++i) {
        std::this_thread::sleep_for(25ms);
        peak = std::max(peak, dcomm::test::resident_kib(server));
      }
    }
    ::kill(server, SIGKILL);
    ::waitpid(server, nullptr, 0);
    CHECK(during == "2");
    CHECK(before > 0);
    // 6 x 64 MiB if announced lengths were allocated.
    CHECK_MESSAGE(peak - before < 64 * 1024,
                  "server resident memory grew by " << (peak - before) / 1024 << " MiB");
  }
}

TEST_SUITE("tcp_store auth") {
  TEST_CASE("job tokens: matching, wrong, missing, and a downgrade") {
    DCOMM_TEST_DEADLINE(60s);
    if (!dcomm::detail::have_crypto()) {
      // Without OpenSSL a token is refused at start-up, never ignored.
      asio::io_context ctx;
      auto what = expect_error(errc::unsupported, [&] {
        dcomm::tcp_store::create(ctx.get_executor(), {.port = 1, .job_token = "secret"});
      });
      CHECK(contains(what, "DCOMM_JOB_TOKEN"));
      // Both ways out, for a user without Meson whose launcher set the token.
      CHECK(contains(what, "-DDCOMM_HAS_OPENSSL=1 and -lcrypto"));
      CHECK(contains(what, "dcomm-run --no-auth"));
      return;
    }
    dcomm::test::tcp_world secured("127.0.0.1", "s3cret-token");
    asio::io_context ctx;
    auto client = [&](std::string token) {
      return dcomm::tcp_store::create(
          ctx.get_executor(),
          {.host = "127.0.0.1", .port = secured.port(), .timeout = 5s, .job_token = token});
    };
    auto ok = client("s3cret-token");
    dcomm::sync_wait(ctx, ok->set("k", "v"));
    CHECK(dcomm::sync_wait(ctx, ok->get("k")) == "v");

    auto what =
        expect_error(errc::auth_failed, [&] { dcomm::sync_wait(ctx, client("wrong")->connect()); });
    CHECK(contains(what, "could not prove"));
    what = expect_error(errc::auth_failed, [&] { dcomm::sync_wait(ctx, client("")->connect()); });
    CHECK(contains(what, "DCOMM_JOB_TOKEN"));

    dcomm::test::tcp_world open("127.0.0.1");
    auto downgraded = dcomm::tcp_store::create(
        ctx.get_executor(), {.host = "127.0.0.1", .port = open.port(), .job_token = "s3cret"});
    what = expect_error(errc::auth_failed, [&] { dcomm::sync_wait(ctx, downgraded->connect()); });
    CHECK(contains(what, "does not ask"));
    // The secured server still serves its clients.
    CHECK(dcomm::sync_wait(ctx, ok->get("k")) == "v");
  }

  TEST_CASE("the token never crosses the wire") {
    DCOMM_TEST_DEADLINE(30s);
    if (!dcomm::detail::have_crypto()) return;
    const std::string token = "plain-text-token-value";
    // A fake server that asks for the token, records every byte the client
    // sends (hello and proof), then refuses.
    asio::io_context ctx;
    asio::ip::tcp::acceptor acceptor(ctx, {asio::ip::make_address("127.0.0.1"), 0});
    std::string received;
    std::jthread server([&] {
      auto sock = acceptor.accept();
      auto read = [&](std::size_t n) {
        std::string bytes(n, '\0');
        asio::read(sock, asio::buffer(bytes));
        received += bytes;
        return bytes;
      };
      auto head = read(4 + 2 + 4);
      dcomm::detail::wire_reader r(head);
      r.raw(4);
      r.u16();
      read(r.u32() + 4 + 32);  // purpose, rank, nonce
      dcomm::detail::wire_writer offer;
      offer.raw("DCMH").u16(dcomm::detail::protocol_version).u8(1).raw(std::string(32, 'n'));
      asio::write(sock, asio::buffer(offer.bytes()));
      read(1 + 32);  // the proof
      dcomm::detail::wire_writer verdict;
      verdict.u8(0).str("test over");
      asio::write(sock, asio::buffer(verdict.bytes()));
    });
    auto c = dcomm::tcp_store::create(
        ctx.get_executor(),
        {.host = "127.0.0.1", .port = acceptor.local_endpoint().port(), .job_token = token});
    auto what = expect_error(errc::auth_failed, [&] { dcomm::sync_wait(ctx, c->connect()); });
    server.join();
    CHECK(contains(what, "test over"));
    CHECK(received.size() == 4 + 2 + 4 + 5 + 4 + 32 + 33);
    CHECK_FALSE(contains(received, token));
  }
}

// c10d's TCPStore (store/c10d_store.hpp): torch 2's protocol as
// c10d_server.py serves it, and what any server can do to a client.
TEST_SUITE("c10d_store") {
  TEST_CASE("c10d_store keeps the store contract on torch 2's protocol") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::test::c10d_world world("torch2");
    check_store_contract(world);
    asio::io_context ctx;
    auto s = std::static_pointer_cast<dcomm::c10d_store>(world.handle(ctx.get_executor()));
    dcomm::sync_wait(ctx, s->check(keys("any")));
    CHECK(s->protocol() == "torch 2");
  }

  TEST_CASE("rendezvous joins torchrun's agent store under the workers' prefix") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::test::c10d_server agent("torch2");
    check_agent_store_rendezvous(agent);
  }

  TEST_CASE("a server that is no TCPStore, or says nothing, is named at the deadline") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::test::tcp_world dcomm_server;   // dcomm's own store: waits for its handshake
    dcomm::test::listening_socket silent;  // accepts (the backlog), never reads
    for (auto port : {dcomm_server.port(), silent.port}) {
      const auto started = std::chrono::steady_clock::now();
      auto what = expect_error(errc::timeout, [&] {
        auto s = dcomm::c10d_store::create({.port = port, .timeout = 500ms});
        s->set("k", "v", dcomm::blocking);
      });
      CHECK(std::chrono::steady_clock::now() - started < 10s);
      CHECK(contains(what, "expected c10d's TCPStore protocol"));
      CHECK(contains(what, "did not answer dcomm's probe"));
      CHECK(contains(what, "127.0.0.1:" + std::to_string(port)));
    }
  }

  TEST_CASE("a server that dies fails a pending wait with peer_lost, naming the store") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::test::c10d_server agent("torch2");
    auto s = dcomm::c10d_store::create({.port = agent.port, .timeout = 30s});
    s->set("first", "1", dcomm::blocking);
    auto waiting = s->wait(keys("never"), asio::use_future);
    std::this_thread::sleep_for(200ms);
    const auto started = std::chrono::steady_clock::now();
    agent.kill();
    auto what = expect_error(errc::peer_lost, [&] { waiting.get(); });
    CHECK(std::chrono::steady_clock::now() - started < 10s);
    CHECK(contains(what, "c10d_store.wait"));
    CHECK(contains(what, "closed the connection"));
    CHECK(contains(what, "127.0.0.1:" + std::to_string(agent.port)));
  }
}

// The same against torch.distributed.TCPStore itself (Debian's
// python3-torch, torch 1.13: meson's test 'c10d_store torch', skipped
// where no Python has torch).
TEST_SUITE("c10d_store torch") {
  TEST_CASE("c10d_store keeps the store contract on torch's own TCPStore") {
    DCOMM_TEST_DEADLINE(90s);
    dcomm::test::c10d_world world("torch");
    check_store_contract(world);
  }

  TEST_CASE("keys cross between Python's TCPStore and C++") {
    DCOMM_TEST_DEADLINE(60s);
    dcomm::test::c10d_server py("torch");
    auto s = dcomm::c10d_store::create({.port = py.port, .timeout = 30s});
    CHECK(py.command("set from_python hello") == "ok");
    CHECK(s->get("from_python", dcomm::blocking) == "hello");
    CHECK(s->protocol() == "torch 1");
    auto later = s->get("later", 20s, asio::use_future);
    s->set("from_cpp", "world", dcomm::blocking);
    CHECK(py.command("get from_cpp") == "world");
    CHECK(py.command("set later now") == "ok");
    CHECK(later.get() == "now");
  }

  TEST_CASE("rendezvous joins torchrun's agent store (torch's own TCPStore)") {
    DCOMM_TEST_DEADLINE(90s);
    dcomm::test::c10d_server agent("torch");
    check_agent_store_rendezvous(agent);
  }
}
