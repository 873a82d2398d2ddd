// How the ranks of one host come to share a segment (shm/segment.hpp): the
// lowest of them makes it, listens on an abstract unix socket whose random
// name it publishes through the store, and hands the memfd and the
// doorbells' eventfds to each of the others (SCM_RIGHTS), which map them
// before they connect their mesh (cpu/startup/connect.hpp).
// Abstract sockets vanish with their process and need no file, so a job
// killed at any moment leaves nothing behind. A connection from a process
// of another user, or one that does not say which expected rank it is, is
// dropped; it cannot delay the real ranks past a short grace.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/clock.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/error.hpp"
#include "dcomm/shm/segment.hpp"
#include "dcomm/store/store.hpp"

namespace dcomm::shm {

// Asio has no local seq_packet protocol: the generic one with AF_UNIX.
using unix_protocol = asio::generic::seq_packet_protocol;
using unix_socket = unix_protocol::socket;
using unix_acceptor = asio::basic_socket_acceptor<unix_protocol>;

namespace handover_detail {

// A failed socket call, in Asio's category: detail::socket_error_code then
// sees a reset or a refusal as what it is (peer_lost, connect_failed).
[[noreturn]] inline void throw_socket_errno(const char* what) {
  throw asio::system_error(asio::error_code(errno, asio::error::get_system_category()), what);
}

inline constexpr std::uint64_t hello_magic = 0x64636f6d6d68656cull;  // "dcommhel"
struct hello {
  std::uint64_t magic = hello_magic;
  std::int32_t rank = -1;  // the connecting rank (global)
  std::int32_t reserved = 0;
};

inline std::string random_name() {
  std::random_device rd;
  std::string name = "dcomm-shm-";
  for (int i = 0; i < 4; ++i) {
    char part[9];
    std::snprintf(part, sizeof part, "%08x", static_cast<unsigned>(rd()));
    name += part;
  }
  return name;
}

// A name in the abstract namespace: a leading NUL, no file.
inline unix_protocol::endpoint abstract_endpoint(const std::string& name) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const std::size_t n = std::min(name.size(), sizeof a.sun_path - 1);
  std::memcpy(a.sun_path + 1, name.data(), n);
  return unix_protocol::endpoint(&a, offsetof(sockaddr_un, sun_path) + 1 + n, 0);
}

// Sends `bytes` with the descriptors `fds` attached.
inline void send_with_fds(int socket, const void* bytes, std::size_t n,
                          const std::vector<int>& fds) {
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  iovec iov{const_cast<void*>(bytes), n};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
  std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  if (::sendmsg(socket, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(n))
    throw_socket_errno("sendmsg of the shared memory segment");
}

// Receives one message of `n` bytes and the descriptors attached to it
// (closed again if the message is not what was expected); nothing if none
// has come yet (see wait_readable).
inline std::optional<std::vector<int>> receive_with_fds(int socket, void* bytes, std::size_t n,
                                                        std::size_t max_fds) {
  std::vector<char> control(CMSG_SPACE(sizeof(int) * max_fds));
  iovec iov{bytes, n};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  const ssize_t got = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return std::nullopt;
  if (got < 0) throw_socket_errno("recvmsg of the shared memory segment");
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      const std::size_t at = fds.size();
      fds.resize(at + k);
      std::memcpy(fds.data() + at, CMSG_DATA(c), k * sizeof(int));
    }
  if (got != static_cast<ssize_t>(n) || (msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC))) {
    for (int fd : fds) ::close(fd);
    throw std::system_error(EPROTO, std::system_category(),
                            "a short or truncated shared memory handover");
  }
  return fds;
}

// Waits until `sock` has something to read, or throws errc::timeout with
// `late` at the deadline. Readiness can be spurious where several threads
// run the io_context (one of them may handle a readiness event of the
// socket's, true before it connected, after this wait began): callers
// read without blocking, and wait again when nothing was there.
// (`late`: the caller's, alive across the wait. Named and moved, never a
// temporary in a co_await: g++ 12 destroys those twice.)
DCOMM_EMIT_ON_USE asio::awaitable<void> wait_readable(unix_socket& sock,
                                                      detail::clock::time_point deadline,
                                                      const error_context& late) {
  error_context on_timeout = late;
  auto waiting = sock.async_wait(asio::socket_base::wait_read, asio::use_awaitable);
  co_await detail::with_deadline(std::move(waiting), deadline, std::move(on_timeout), [&sock] {
    asio::error_code ignored;
    sock.cancel(ignored);
  });
}

inline bool same_user(unix_socket& s) {
  ucred cred{};
  socklen_t len = sizeof cred;
  return ::getsockopt(s.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0 &&
         cred.uid == ::getuid();
}

inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ",") + std::to_string(r);
  return "ranks {" + s + "}";
}

// What the lowest rank serves while its own start-up goes on.
struct server_state {
  std::shared_ptr<segment> seg;
  unix_acceptor acceptor;
  std::vector<int> missing;  // the ranks not served yet
};

// One connection: a real rank says who it is at once and gets the segment;
// anything else is dropped after a short grace. Each connection is served
// on its own, so a silent stranger delays no one.
DCOMM_EMIT_ON_USE asio::awaitable<void> serve_one(std::shared_ptr<server_state> sv,
                                                  unix_socket peer) {
  if (!same_user(peer)) co_return;
  const auto grace = detail::clock::now() + std::chrono::seconds(2);
  const error_context silent;
  hello h;
  for (;;) {
    try {
      co_await wait_readable(peer, grace, silent);
    } catch (const dcomm::error&) {
      co_return;
    }
    const auto n = ::recv(peer.native_handle(), &h, sizeof h, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n != sizeof h || h.magic != hello_magic) co_return;
    break;
  }
  auto it = std::find(sv->missing.begin(), sv->missing.end(), h.rank);
  if (it == sv->missing.end()) co_return;
  std::vector<int> fds{sv->seg->memfd()};
  fds.insert(fds.end(), sv->seg->bell_fds().begin(), sv->seg->bell_fds().end());
  try {
    send_with_fds(peer.native_handle(), &h, sizeof h, fds);
  } catch (const std::system_error&) {
    co_return;  // it went away: it fails its own start-up
  }
  sv->missing.erase(it);
  if (sv->missing.empty()) {
    asio::error_code ignored;
    sv->acceptor.close(ignored);
  }
}

// Hands the segment to each rank of the host that asks, until all have or
// the start-up deadline passed (a rank that has not come by then failed
// its start-up, and the others learn it from their links).
DCOMM_EMIT_ON_USE asio::awaitable<void> serve(std::shared_ptr<server_state> sv,
                                              detail::clock::time_point deadline) {
  auto ex = co_await asio::this_coro::executor;
  auto timer = std::make_shared<asio::steady_timer>(ex, deadline);
  timer->async_wait([sv](const asio::error_code&) {
    asio::error_code ignored;
    sv->acceptor.close(ignored);
  });
  while (sv->acceptor.is_open()) {
    unix_socket peer(ex);
    asio::error_code ec;
    co_await sv->acceptor.async_accept(peer, asio::redirect_error(asio::use_awaitable, ec));
    if (ec == asio::error::operation_aborted || !sv->acceptor.is_open()) co_return;
    if (!ec) asio::co_spawn(ex, serve_one(sv, std::move(peer)), asio::detached);
  }
  timer->cancel();
}

// The lowest rank: makes the segment, publishes where to fetch it, and
// serves it in the background: its start-up goes on at once, so that it
// never waits for a rank that died here (the mesh names such a rank).
DCOMM_EMIT_ON_USE asio::awaitable<std::shared_ptr<server_state>> lead(
    std::shared_ptr<store> s, std::string key, std::vector<int> local, segment_sizes sizes,
    detail::clock::time_point deadline) {
  auto ex = co_await asio::this_coro::executor;
  auto sv = std::make_shared<server_state>(
      server_state{std::make_shared<segment>(segment::create(local.size(), sizes)),
                   unix_acceptor(ex), std::vector<int>(local.begin() + 1, local.end())});
  std::string name;
  for (int attempt = 0;; ++attempt) {  // a name taken by chance: draw again
    name = random_name();
    asio::error_code ec;
    sv->acceptor = unix_acceptor(ex);
    sv->acceptor.open(unix_protocol(AF_UNIX, 0), ec);
    if (!ec) sv->acceptor.bind(abstract_endpoint(name), ec);
    if (!ec) sv->acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (!ec) break;
    if (attempt == 8) throw std::system_error(ec, "listening for the host's ranks");
  }
  co_await s->set(key, name);
  asio::co_spawn(ex, serve(sv, deadline), asio::detached);
  co_return sv;
}

// Any other rank: fetches the segment from the lowest.
DCOMM_EMIT_ON_USE asio::awaitable<std::shared_ptr<segment>> join(
    std::shared_ptr<store> s, std::string key, int rank, std::vector<int> local,
    detail::clock::time_point deadline) {
  auto ex = co_await asio::this_coro::executor;
  const auto left = detail::time_left(deadline);
  const std::string name = co_await s->get(key, left);
  unix_socket sock(ex);
  sock.connect(abstract_endpoint(name));
  hello h;
  h.rank = rank;
  if (::send(sock.native_handle(), &h, sizeof h, MSG_NOSIGNAL) != sizeof h)
    throw_socket_errno("send to the host's lowest rank");
  error_context late{
      .operation = "shm handover",
      .rank = rank,
      .peers = "rank " + std::to_string(local.front()),
      .detail = "the host's lowest rank did not hand over the shared memory segment"};
  hello answer;
  std::optional<std::vector<int>> received;
  while (!received) {
    co_await wait_readable(sock, deadline, late);
    received = receive_with_fds(sock.native_handle(), &answer, sizeof answer, local.size() + 1);
  }
  std::vector<int> fds = std::move(*received);
  if (answer.magic != hello_magic || answer.rank != rank || fds.size() != local.size() + 1) {
    for (int fd : fds) ::close(fd);
    throw std::system_error(EPROTO, std::system_category(),
                            "the shared memory handover is not dcomm's");
  }
  const int memfd = fds.front();
  fds.erase(fds.begin());
  co_return std::make_shared<segment>(segment::attach(memfd, std::move(fds)));
}

}  // namespace handover_detail

// The segment shared by `local` (the global ranks of this host, ascending,
// this rank among them); `key` is where the lowest publishes its socket.
// The lowest serves the others in the background until all came, the
// deadline passed or stop(). Failures are dcomm::errors naming this rank
// and what failed.
class host_segment {
 public:
  DCOMM_EMIT_ON_USE static asio::awaitable<host_segment> open(std::shared_ptr<store> s,
                                                              std::string key, int rank,
                                                              std::vector<int> local,
                                                              segment_sizes sizes,
                                                              detail::clock::time_point deadline);

  const std::shared_ptr<segment>& get() const { return segment_; }
  // Ranks that have not fetched the segment by now cannot join any more.
  void stop() {
    if (!server_) return;
    asio::error_code ignored;
    server_->acceptor.close(ignored);
    server_.reset();
  }

 private:
  std::shared_ptr<segment> segment_;
  std::shared_ptr<handover_detail::server_state> server_;
};

DCOMM_EMIT_ON_USE_DEFINITION auto host_segment::open(std::shared_ptr<store> s, std::string key,
                                                     int rank, std::vector<int> local,
                                                     segment_sizes sizes,
                                                     detail::clock::time_point deadline)
    -> asio::awaitable<host_segment> {
  std::exception_ptr failure;
  host_segment h;
  const int leader = local.front();
  try {
    if (rank == leader) {
      h.server_ =
          co_await handover_detail::lead(std::move(s), key, std::move(local), sizes, deadline);
      h.segment_ = h.server_->seg;
    } else {
      h.segment_ =
          co_await handover_detail::join(std::move(s), key, rank, std::move(local), deadline);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  // Only the lowest rank can fail a rank that fetches the segment: a
  // reset, a refusal or silence is its loss, and names it.
  const std::string blame = rank == leader ? std::string() : "rank " + std::to_string(leader);
  if (failure) {
    try {
      detail::rethrow_as_dcomm_error(
          failure, {.operation = "shm handover",
                    .rank = rank,
                    .peers = blame,
                    .key = key,
                    .detail = "sharing memory with the ranks of this host failed (set "
                              "DCOMM_TRANSPORT=tcp to go without it)"});
    } catch (const dcomm::error& e) {
      if (!e.context().peers.empty() || blame.empty()) throw;
      error_context c = e.context();
      c.peers = blame;
      throw error(e.code(), std::move(c));
    }
  }
  co_return h;
}

}  // namespace dcomm::shm

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::shm::handover_detail::wait_readable<void>(unix_socket& sock, detail::clock::time_point deadline, const error_context& late) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::shm::handover_detail::serve_one<void>(std::shared_ptr<server_state> sv, unix_socket peer) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::shm::handover_detail::serve<void>(std::shared_ptr<server_state> sv, detail::clock::time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::shm::handover_detail::lead<void>(std::shared_ptr<store> s, std::string key, std::vector<int> local, segment_sizes sizes, detail::clock::time_point deadline) -> asio::awaitable<std::shared_ptr<server_state>>)
DCOMM_INSTANTIATE(auto dcomm::shm::handover_detail::join<void>(std::shared_ptr<store> s, std::string key, int rank, std::vector<int> local, detail::clock::time_point deadline) -> asio::awaitable<std::shared_ptr<segment>>)
DCOMM_INSTANTIATE(auto dcomm::shm::host_segment::open<void>(std::shared_ptr<store> s, std::string key, int rank, std::vector<int> local, segment_sizes sizes, detail::clock::time_point deadline) -> asio::awaitable<host_segment>)
// clang-format on
// End of the separate-compilation block.
