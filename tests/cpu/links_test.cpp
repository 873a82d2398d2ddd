// The link interface (cpu/transport/link.hpp) driven directly, for both
// kinds: two links of one process joined by a loopback TCP connection (a
// socket link each way) or by a pair of rings of a segment made here (a
// shared memory link each way, over the same kind of connection, which it
// watches for the peer's end). Frames go through the queue as the
// transport writes them; a recording stand-in for the transport hears what
// the links tell it.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/cpu/transport/shm_link.hpp"
#include "dcomm/cpu/transport/socket_link.hpp"

namespace {

using namespace dcomm;
using namespace dcomm::cpu;

// What the transport would do with the links' reports, recorded: written
// frames leave the queue, a link whose write ended is asked to write again.
struct recorder final : link_events, std::enable_shared_from_this<recorder> {
  cpu::link* l = nullptr;
  send_queue* q = nullptr;
  std::size_t frames_written = 0, bytes_written = 0;
  asio::error_code error;
  int idle = 0;
  std::optional<wire_header> goodbye;
  std::string lost;

  std::shared_ptr<link_events> keep_alive() override { return shared_from_this(); }
  void written(int, std::size_t frames, std::size_t bytes, const asio::error_code& ec) override {
    for (std::size_t i = 0; i < frames; ++i)
      if (io_item* it = q->frames[i].item) it->in_flight = false;
    q->frames.pop_front(frames);
    q->batch = 0;
    frames_written += frames;
    if (!ec) bytes_written += bytes;
    if (ec) error = ec;
  }
  void write_queued(int) override { l->write(); }
  void reader_idle() override { ++idle; }
  void heard_goodbye(int, const wire_header& bye) override { goodbye = bye; }
  void lose(int, std::string why) override { lost = std::move(why); }
};

// Runs the io_context until `t` ends (10 s at most), returning its result.
template <class T>
T run(asio::io_context& io, detail::task<T> t) {
  std::exception_ptr failed;
  std::optional<T> got;
  bool done = false;
  detail::start(io.get_executor(), std::move(t), [&](std::exception_ptr e, std::optional<T> v) {
    failed = e;
    got = std::move(v);
    done = true;
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done && std::chrono::steady_clock::now() < until)
    io.run_one_for(std::chrono::milliseconds(10));
  io.restart();
  REQUIRE_MESSAGE(done, "the read did not end within 10 s");
  if (failed) std::rethrow_exception(failed);
  return std::move(*got);
}

// Runs the io_context until pred() holds (10 s at most).
template <class Pred>
void run_until(asio::io_context& io, Pred pred) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!pred() && std::chrono::steady_clock::now() < until)
    io.run_one_for(std::chrono::milliseconds(5));
  io.restart();
  REQUIRE(pred());
}

std::pair<detail::ip_tcp::socket, detail::ip_tcp::socket> connected(asio::io_context& io) {
  detail::ip_tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  detail::ip_tcp::socket a(io), b(io);
  a.connect(acceptor.local_endpoint());
  acceptor.accept(b);
  return {std::move(a), std::move(b)};
}

enum class kind { socket, shm };

// Two links, a (rank 0) and b (rank 1), each with its queue and recorder.
struct link_pair {
  static constexpr std::size_t ring_bytes = 4096;
  asio::io_context io;
  std::optional<shm::segment> segment;
  std::unique_ptr<cpu::link> a, b;
  send_queue qa, qb;
  std::shared_ptr<recorder> ra = std::make_shared<recorder>(), rb = std::make_shared<recorder>();

  explicit link_pair(kind k, bool single_copy = false) {
    auto [sa, sb] = connected(io);
    if (k == kind::socket) {
      a = std::make_unique<socket_link>(std::move(sa), io.get_executor(), 16, 64 * 1024);
      b = std::make_unique<socket_link>(std::move(sb), io.get_executor(), 16, 64 * 1024);
    } else {
      segment = shm::segment::create(2, {.ring_bytes = ring_bytes, .slot_bytes = 4096});
      // Who rank 0 is, for a peer that reads its memory (as the transport
      // publishes it: shm/single_copy.hpp).
      shm::process_identity& id = segment->identity(0);
      id.base = reinterpret_cast<std::uintptr_t>(segment->base());
      id.nonce = std::random_device{}() | 1;
      id.pid.store(static_cast<std::uint64_t>(::getpid()));
      a = std::make_unique<shm_link>(std::move(sa), io.get_executor(), *segment, 0, 1, 0,
                                     single_copy);
      b = std::make_unique<shm_link>(std::move(sb), io.get_executor(), *segment, 1, 0, 1,
                                     single_copy);
    }
    ra->l = a.get();
    ra->q = &qa;
    rb->l = b.get();
    rb->q = &qb;
    a->attach(*ra, 1, qa);
    b->attach(*rb, 0, qb);
    a->start();
    b->start();
  }
  ~link_pair() {
    if (a->open()) a->close(nullptr);
    if (b->open()) b->close(nullptr);
    io.restart();
    io.run_for(std::chrono::milliseconds(50));  // the links' own work ends
  }
  // What the transport's poll does for a shared memory link whose writer
  // waits for room (cpu/transport/impl/shm_links.hpp).
  void resume_writer(cpu::link& l) {
    if (auto* s = dynamic_cast<shm_link*>(&l); s && s->writer_blocked && s->ring.writable()) {
      s->writer_blocked = false;
      l.write();
    }
  }
};

wire_header frame_header(msg_kind k, std::uint32_t step, std::size_t bytes) {
  wire_header h;
  h.kind = k;
  h.step = step;
  h.bytes = bytes;
  return h;
}

// Reads one frame (header and payload) from `l`, as the transport's reader
// does: whatever is there at once, then waits.
detail::task<std::pair<wire_header, std::vector<char>>> read_frame(cpu::link& l) {
  wire_header h;
  std::size_t got = l.read_now(&h, sizeof h);
  if (got < sizeof h) co_await l.read(reinterpret_cast<char*>(&h) + got, sizeof h - got, true);
  std::vector<char> payload(h.bytes);
  got = l.read_now(payload.data(), payload.size());
  if (got < payload.size()) co_await l.read(payload.data() + got, payload.size() - got, true);
  co_return std::pair{h, std::move(payload)};
}

std::vector<char> pattern(std::size_t n, int seed) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed * 7) & 0xff);
  return v;
}

}  // namespace

TEST_SUITE("cpu links") {
  TEST_CASE("each kind says what it can do") {
    link_pair s(kind::socket), m(kind::shm);
    CHECK(s.a->abilities.carries == transports::tcp);
    CHECK_FALSE(s.a->abilities.cheap_reads);
    CHECK_FALSE(s.a->abilities.polled);
    CHECK_FALSE(s.a->abilities.host_arena);
    CHECK(m.a->abilities.carries == transports::shm);
    CHECK(m.a->abilities.cheap_reads);
    CHECK(m.a->abilities.polled);
    CHECK(m.a->abilities.host_arena);
    wire_header rts = frame_header(msg_kind::rts, 0, 1 << 20);
    CHECK_FALSE(s.a->offer(rts, &rts));
    CHECK_FALSE(m.a->offer(rts, &rts));  // single copy not asked for
    CHECK(rts.cookie2 == 0);
  }

  TEST_CASE("frames are read back whole and in order, payloads of 0 bytes included") {
    for (kind k : {kind::socket, kind::shm}) {
      CAPTURE(k == kind::socket ? "socket" : "shm");
      link_pair p(k);
      const std::vector<std::size_t> sizes = {0, 1, 100, 0, 3000, 7};
      std::vector<std::vector<char>> payloads;
      for (std::size_t i = 0; i < sizes.size(); ++i) payloads.push_back(pattern(sizes[i], int(i)));
      for (std::size_t i = 0; i < sizes.size(); ++i)
        p.qa.frames.push_back(
            {frame_header(msg_kind::eager, static_cast<std::uint32_t>(i), sizes[i]),
             payloads[i].data(), sizes[i], nullptr});
      p.a->write();
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        p.resume_writer(*p.a);
        auto [h, payload] = run(p.io, read_frame(*p.b));
        CHECK(h.magic == wire_magic);
        CHECK(h.kind == msg_kind::eager);
        CHECK(h.step == i);
        CHECK(payload == payloads[i]);
      }
      run_until(p.io, [&] { return p.ra->frames_written == sizes.size(); });
      std::size_t bytes = 0;
      for (std::size_t n : sizes) bytes += sizeof(wire_header) + n;
      CHECK(p.ra->bytes_written == bytes);
      CHECK(p.qa.frames.empty());
      CHECK_FALSE(p.ra->error);
    }
  }

  TEST_CASE("a frame larger than the link holds at once is written in parts, in flight meanwhile") {
    for (kind k : {kind::socket, kind::shm}) {
      CAPTURE(k == kind::socket ? "socket" : "shm");
      link_pair p(k);
      // Over the socket's buffers too, so that its write ends only once the
      // peer has read.
      const std::size_t n = k == kind::shm ? 5 * link_pair::ring_bytes + 17 : (32u << 20) + 17;
      const std::vector<char> big = pattern(n, 3), small = pattern(10, 4);
      io_item item;
      item.bytes = n;
      p.qa.frames.push_back({frame_header(msg_kind::eager, 1, n), big.data(), n, &item});
      p.qa.frames.push_back({frame_header(msg_kind::eager, 2, 10), small.data(), 10, nullptr});
      p.a->write();
      CHECK(item.in_flight);  // the link holds its bytes: its call may not give the buffer back
      CHECK(p.qa.batch >= 1);
      CHECK(p.ra->frames_written == 0);
      // The peer reads; a shared memory writer goes on as the transport's
      // poll would resume it.
      wire_header h;
      CHECK(run(p.io, p.b->read(&h, sizeof h, true)) == sizeof h);
      CHECK(h.bytes == n);
      std::vector<char> got(n);
      std::size_t have = 0;
      const std::size_t piece = k == kind::shm ? 3000 : std::size_t{1} << 20;
      while (have < n) {
        p.resume_writer(*p.a);
        have += run(p.io, p.b->read(got.data() + have, std::min(n - have, piece), false));
      }
      CHECK(got == big);
      p.resume_writer(*p.a);
      auto [h2, payload] = run(p.io, read_frame(*p.b));
      CHECK(h2.step == 2);
      CHECK(payload == small);
      run_until(p.io, [&] { return p.ra->frames_written == 2; });
      CHECK_FALSE(item.in_flight);
    }
  }

  TEST_CASE("a read of exactly 0 bytes ends at once and takes nothing") {
    for (kind k : {kind::socket, kind::shm}) {
      CAPTURE(k == kind::socket ? "socket" : "shm");
      link_pair p(k);
      char c = 'x';
      CHECK(p.b->read_now(&c, 0) == 0);
      CHECK(run(p.io, p.b->read(&c, 0, true)) == 0);
      const std::vector<char> one = {'y'};
      p.qa.frames.push_back({frame_header(msg_kind::eager, 5, 1), one.data(), 1, nullptr});
      p.a->write();
      CHECK(run(p.io, p.b->read(&c, 0, true)) == 0);
      auto [h, payload] = run(p.io, read_frame(*p.b));
      CHECK(h.step == 5);
      CHECK(payload == one);
    }
  }

  TEST_CASE("after a close, the peer reads what was written, then the end") {
    for (kind k : {kind::socket, kind::shm}) {
      CAPTURE(k == kind::socket ? "socket" : "shm");
      link_pair p(k);
      const std::vector<char> last = pattern(50, 9);
      p.qa.frames.push_back({frame_header(msg_kind::eager, 7, 50), last.data(), 50, nullptr});
      p.a->write();
      run_until(p.io, [&] { return p.ra->frames_written == 1; });
      p.a->close(nullptr);
      CHECK_FALSE(p.a->open());
      auto [h, payload] = run(p.io, read_frame(*p.b));
      CHECK(h.step == 7);
      CHECK(payload == last);
      char c;
      try {
        run(p.io, p.b->read(&c, 1, false));
        FAIL("a read after the peer closed ended without an error");
      } catch (const asio::system_error& e) {
        CHECK(e.code() == asio::error::eof);
      }
      // Closed here: a read fails too, it never waits.
      p.b->close(nullptr);
      CHECK_THROWS_AS(run(p.io, p.b->read(&c, 1, false)), asio::system_error);
    }
  }

  TEST_CASE("shut for sending: the peer hears the goodbye, and nothing is left unread") {
    for (kind k : {kind::socket, kind::shm}) {
      CAPTURE(k == kind::socket ? "socket" : "shm");
      link_pair p(k);
      const std::vector<char> data = pattern(300, 1);
      const wire_header bye = goodbye(fail_reason::mismatch, 3);
      p.qa.frames.push_back({frame_header(msg_kind::eager, 1, 300), data.data(), 300, nullptr});
      p.qa.frames.push_back({bye, nullptr, 0, nullptr});  // the transport's last frame
      p.a->write();
      run_until(p.io, [&] { return p.qa.frames.empty(); });
      p.a->shut_for_sending(bye);
      CHECK(p.a->open());
      auto [h, payload] = run(p.io, read_frame(*p.b));
      CHECK(payload == data);
      auto [b, none] = run(p.io, read_frame(*p.b));
      CHECK(b.kind == msg_kind::bye);
      CHECK(read_goodbye(b, 4) == std::pair{fail_reason::mismatch, 3});
      run_until(p.io, [&] { return p.a->unacknowledged() == 0; });
      if (k == kind::shm) {
        // Its socket said goodbye too, for a peer still in its mesh.
        run_until(p.io, [&] { return p.rb->goodbye.has_value(); });
        CHECK(read_goodbye(*p.rb->goodbye, 4) == std::pair{fail_reason::mismatch, 3});
      }
    }
  }

  TEST_CASE("a shared memory reader that waits tells the transport it is idle") {
    link_pair p(kind::shm);
    char c;
    bool done = false;
    detail::start(p.io.get_executor(), p.b->read(&c, 1, false),
                  [&](std::exception_ptr, std::optional<std::size_t>) { done = true; });
    run_until(p.io, [&] { return p.rb->idle > 0; });
    CHECK_FALSE(done);
    auto& s = static_cast<shm_link&>(*p.b);
    CHECK(s.reader_waiting);
    CHECK_FALSE(s.wake_reader());  // nothing to read yet
    const char x = 'x';
    p.qa.frames.push_back({frame_header(msg_kind::eager, 0, 1), &x, 1, nullptr});
    p.a->write();
    CHECK(s.wake_reader());  // as the transport's poll does
    run_until(p.io, [&] { return done; });
  }

  TEST_CASE("a large message offered over shared memory is read in one copy, unless withdrawn") {
    link_pair p(kind::shm, true);
    const std::vector<char> data = pattern(100000, 5);
    wire_header rts = frame_header(msg_kind::rts, 0, data.size());
    REQUIRE(p.a->offer(rts, data.data()));
    CHECK(rts.cookie2 == reinterpret_cast<std::uintptr_t>(data.data()));
    std::vector<char> got(data.size());
    if (!static_cast<shm_link&>(*p.b).may_read()) {
      MESSAGE("process_vm_readv is refused here: single copy not checked");
      return;
    }
    CHECK(p.b->read_offered(got.data(), got.size(), rts));
    CHECK(got == data);
    CHECK(p.b->bytes_read_directly == data.size());
    // Taken back meanwhile: what was read may be torn, so it is refused.
    p.a->withdraw_offer();
    CHECK_FALSE(p.b->read_offered(got.data(), got.size(), rts));
    // Nothing to read in 0 bytes.
    CHECK_FALSE(p.b->read_offered(got.data(), 0, rts));
  }

  TEST_CASE("a shared memory writer waiting for room is lost with its peer") {
    link_pair p(kind::shm);
    const std::size_t n = 3 * link_pair::ring_bytes;
    const std::vector<char> big = pattern(n, 2);
    p.qa.frames.push_back({frame_header(msg_kind::eager, 0, n), big.data(), n, nullptr});
    p.a->write();
    CHECK(static_cast<shm_link&>(*p.a).writer_blocked);
    p.b->close(nullptr);  // the peer goes without reading
    run_until(p.io, [&] { return !p.ra->lost.empty(); });
    CHECK(p.ra->lost.find("closed the connection") != std::string::npos);
  }
}
