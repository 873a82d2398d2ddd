// The handshake that opens every dcomm TCP connection (store clients and,
// later, backend peer links). It checks the protocol magic and version, what
// the connection is for (its purpose), and — when a job token is set — that
// both sides hold the token, by HMAC challenge-response: the token itself is
// never sent.
//
//   client -> server  hello:   "DCMH" u16 version, str purpose, i32 rank, nonce_c[32]
//   server -> client  offer:   "DCMH" u16 version, u8 auth, nonce_s[32]
//   client -> server  proof:   u8 kind, mac_c[32] = HMAC(token, "dcomm-client" purpose nonce_s
//                              nonce_c)
//   server -> client  verdict: u8 accepted, str reason, mac_s[32] = HMAC(token,
//                              "dcomm-server" ...)
//
// The proof's kind is 1 with a MAC; 0 when the client has no token; 2 when
// the client holds a token and the server asks for none: the client leaves,
// and the server learns why (so both sides of a job where one rank lacks
// the token can say so), instead of seeing a bare end of file.
//
// Each side authenticates the other (mutual), labels keep a reflected proof
// from verifying, and fresh nonces on both sides defeat replay. A client with
// a token refuses a server that does not ask for one (no silent downgrade).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <string_view>

#include "dcomm/detail/hmac.hpp"
#include "dcomm/detail/log.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/detail/wire.hpp"

namespace dcomm::detail {

// The job token every rank of a job shares (empty: none): the default of
// the options of the store, the mesh and the communicator.
inline std::string job_token_from_environment() {
  const char* t = std::getenv("DCOMM_JOB_TOKEN");
  return t ? t : "";
}

inline constexpr std::string_view handshake_magic = "DCMH";
inline constexpr std::uint16_t protocol_version = 1;
inline constexpr std::size_t max_purpose_length = 64;
inline constexpr std::uint8_t proof_none = 0;
inline constexpr std::uint8_t proof_mac = 1;
inline constexpr std::uint8_t proof_refuses_server = 2;
// A dcomm server answers a hello at once; after this long in silence the
// client warns that another program may hold the port.
inline constexpr std::chrono::seconds silent_server_warning{5};

struct handshake_config {
  std::string purpose{};  // "store", "tcp_backend", ...
  std::string token{};    // empty: no authentication
  int rank = -1;          // ours, for the peer's messages
};

namespace handshake_detail {

inline std::string proof_message(std::string_view label, std::string_view purpose,
                                 const nonce& first, const nonce& second) {
  std::string m(label);
  m += purpose;
  m.append(reinterpret_cast<const char*>(first.data()), first.size());
  m.append(reinterpret_cast<const char*>(second.data()), second.size());
  return m;
}

DCOMM_EMIT_ON_USE asio::awaitable<void> write_all(ip_tcp::socket& socket, std::string bytes,
                                                  detail::clock::time_point deadline,
                                                  const error_context& ctx) {
  co_await with_deadline(asio::async_write(socket, asio::buffer(bytes), asio::use_awaitable),
                         deadline, ctx, [&socket] {
                           asio::error_code ignored;
                           socket.cancel(ignored);
                         });
}

DCOMM_EMIT_ON_USE asio::awaitable<std::string> read_n(ip_tcp::socket& socket, std::size_t n,
                                                      detail::clock::time_point deadline,
                                                      const error_context& ctx) {
  std::string bytes(n, '\0');
  co_await with_deadline(asio::async_read(socket, asio::buffer(bytes), asio::use_awaitable),
                         deadline, ctx, [&socket] {
                           asio::error_code ignored;
                           socket.cancel(ignored);
                         });
  co_return bytes;
}

inline std::string_view as_view(const std::array<unsigned char, 32>& a) {
  return {reinterpret_cast<const char*>(a.data()), a.size()};
}

inline void copy_into(std::array<unsigned char, 32>& a, std::string_view s) {
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<unsigned char>(s[i]);
}

// A proof without a MAC, sent by a client that is leaving, so that the
// server can name the reason. Best effort: the client fails either way.
DCOMM_EMIT_ON_USE asio::awaitable<void> send_bare_proof(ip_tcp::socket& socket, std::uint8_t kind,
                                                        detail::clock::time_point deadline,
                                                        const error_context& ctx) {
  wire_writer proof;
  proof.u8(kind).raw(std::string(32, '\0'));
  try {
    co_await write_all(socket, std::move(proof.bytes()), deadline, ctx);
  } catch (const std::exception&) {
  }
}

// The first bytes another program sent, for a message: at most 24, the
// unprintable ones as '.'.
inline std::string printable_prefix(std::string_view bytes) {
  std::string s;
  for (char c : bytes.substr(0, 24)) s += (c >= 0x20 && c < 0x7f) ? c : '.';
  return s;
}

// The server's first answer. Silence is what another program on the port
// (one that waits for its own protocol) looks like: warned of after
// silent_server_warning, and named in the timeout at the deadline.
DCOMM_EMIT_ON_USE asio::awaitable<std::string> read_offer(ip_tcp::socket& socket,
                                                          detail::clock::time_point deadline,
                                                          const error_context& ctx) {
  constexpr std::size_t size = 4 + 2 + 1 + 32;
  const auto warn_at = std::min(deadline, detail::clock::now() + silent_server_warning);
  bool warned = false;
  for (;;) {
    std::exception_ptr failure;
    try {
      co_return co_await read_n(socket, size, warned ? deadline : warn_at, ctx);
    } catch (const dcomm::error& e) {
      if (e.code() != errc::timeout) throw;
      failure = std::current_exception();
    }
    if (warned || warn_at >= deadline) {
      auto c = ctx;
      c.detail =
          "nothing answered the handshake: another program (not a dcomm server) may hold the "
          "port, or the process there is stopped";
      throw error(errc::timeout, c);
    }
    warned = true;
    log(log_level::warning, "nothing has answered the handshake at " + ctx.address + " for " +
                                std::to_string(silent_server_warning.count()) +
                                " s (a dcomm server answers at once): another program may hold "
                                "the port, or the process there is stopped; waiting until the "
                                "deadline");
  }
}

DCOMM_EMIT_ON_USE asio::awaitable<void> client_steps(ip_tcp::socket& socket,
                                                     const handshake_config& config,
                                                     const std::string& address,
                                                     detail::clock::time_point deadline) {
  error_context ctx{.operation = "handshake (" + config.purpose + ")",
                    .rank = config.rank >= 0 ? std::optional<int>(config.rank) : std::nullopt,
                    .address = address};
  nonce nonce_c = make_nonce();
  wire_writer hello;
  hello.raw(handshake_magic)
      .u16(protocol_version)
      .str(config.purpose)
      .u32(static_cast<std::uint32_t>(config.rank))
      .raw(as_view(nonce_c));
  co_await write_all(socket, std::move(hello.bytes()), deadline, ctx);

  std::string offer = co_await read_offer(socket, deadline, ctx);
  wire_reader r(offer);
  if (r.raw(4) != handshake_magic) {
    ctx.detail = "another program answers at this address, not a dcomm server (it sent \"" +
                 printable_prefix(offer) +
                 "\"): is the port taken by something else? (MASTER_PORT, the URL's port)";
    throw error(errc::protocol_error, ctx);
  }
  if (auto v = r.u16(); v != protocol_version) {
    ctx.expected = "protocol version " + std::to_string(protocol_version);
    ctx.seen = std::to_string(v);
    throw error(errc::mismatch, ctx);
  }
  bool auth = r.u8() != 0;
  nonce nonce_s{};
  copy_into(nonce_s, r.raw(32));
  if (!config.token.empty() && !auth) {
    co_await send_bare_proof(socket, proof_refuses_server, deadline, ctx);
    ctx.detail =
        "DCOMM_JOB_TOKEN is set but the server does not ask for it; refusing to join an "
        "unauthenticated server";
    throw error(errc::auth_failed, ctx);
  }
  if (auth && config.token.empty()) {
    co_await send_bare_proof(socket, proof_none, deadline, ctx);
    ctx.detail = "the server requires a job token; set DCOMM_JOB_TOKEN to the job's token";
    throw error(errc::auth_failed, ctx);
  }
  wire_writer proof;
  proof.u8(auth ? proof_mac : proof_none);
  digest mac_c{};
  if (auth)
    mac_c =
        hmac_sha256(config.token, proof_message("dcomm-client", config.purpose, nonce_s, nonce_c));
  proof.raw(as_view(mac_c));
  co_await write_all(socket, std::move(proof.bytes()), deadline, ctx);

  std::string head = co_await read_n(socket, 1 + 4, deadline, ctx);
  wire_reader v(head);
  bool accepted = v.u8() != 0;
  std::uint32_t reason_length = v.u32();
  if (reason_length > 1024) throw error(errc::protocol_error, ctx);
  std::string reason = co_await read_n(socket, reason_length, deadline, ctx);
  if (!accepted) {
    ctx.detail = "the server refused the connection: " + reason;
    throw error(errc::auth_failed, ctx);
  }
  std::string server_mac = co_await read_n(socket, 32, deadline, ctx);
  if (auth) {
    digest expected =
        hmac_sha256(config.token, proof_message("dcomm-server", config.purpose, nonce_c, nonce_s));
    digest seen{};
    copy_into(seen, server_mac);
    if (!digest_equal(expected, seen)) {
      ctx.detail = "the server could not prove it holds the job token";
      throw error(errc::auth_failed, ctx);
    }
  }
}

}  // namespace handshake_detail

// Client side. Throws auth_failed (refused, or the tokens disagree),
// protocol_error / mismatch (not a dcomm server of this version), timeout,
// and peer_lost when the connection breaks halfway (reset, end of file):
// always a dcomm::error naming `address`, never a raw socket error.
DCOMM_EMIT_ON_USE asio::awaitable<void> client_handshake(ip_tcp::socket& socket,
                                                         const handshake_config& config,
                                                         std::string address,
                                                         detail::clock::time_point deadline) {
  std::exception_ptr failure;
  try {
    co_await handshake_detail::client_steps(socket, config, address, deadline);
    co_return;
  } catch (...) {
    failure = std::current_exception();
  }
  rethrow_as_dcomm_error(failure,
                         {.operation = "handshake (" + config.purpose + ")",
                          .rank = config.rank >= 0 ? std::optional<int>(config.rank) : std::nullopt,
                          .address = address,
                          .detail = "the connection broke during the handshake"});
}

struct handshake_peer {
  int rank = -1;
  std::string purpose{};
};

// Decides, once the client has proved what it must, whether the server
// takes it: "" to accept, else the reason for refusing (sent in the verdict).
using handshake_admit = std::function<std::string(const handshake_peer&)>;

// Server side. On refusal it tells the client why, then throws auth_failed
// (the caller logs it and drops the connection). `admit`, when set, runs
// only for a client that passed every other check, before the verdict: so
// a caller that reserves something there (the mesh: the peer's rank) does
// so for proven clients only, and the refused client hears why. A broken
// connection comes out as the socket's std::system_error: the caller drops
// it either way.
DCOMM_EMIT_ON_USE asio::awaitable<handshake_peer> server_handshake(
    ip_tcp::socket& socket, const handshake_config& config, std::string peer_address,
    detail::clock::time_point deadline, handshake_admit admit = {}) {
  using namespace handshake_detail;
  error_context ctx{.operation = "handshake (" + config.purpose + ")", .address = peer_address};
  std::string head = co_await read_n(socket, 4 + 2 + 4, deadline, ctx);
  wire_reader r(head);
  if (r.raw(4) != handshake_magic) {
    ctx.detail = "not a dcomm client (wrong magic)";
    throw error(errc::protocol_error, ctx);
  }
  std::uint16_t version = r.u16();
  std::uint32_t purpose_length = r.u32();
  if (purpose_length > max_purpose_length) {
    ctx.detail = "purpose too long";
    throw error(errc::protocol_error, ctx);
  }
  std::string rest = co_await read_n(socket, purpose_length + 4 + 32, deadline, ctx);
  wire_reader h(rest);
  handshake_peer peer;
  peer.purpose = std::string(h.raw(purpose_length));
  peer.rank = static_cast<std::int32_t>(h.u32());
  nonce nonce_c{};
  copy_into(nonce_c, h.raw(32));
  if (peer.rank >= 0) ctx.rank = peer.rank;

  bool auth = !config.token.empty();
  nonce nonce_s = make_nonce();
  wire_writer offer;
  offer.raw(handshake_magic).u16(protocol_version).u8(auth ? 1 : 0).raw(as_view(nonce_s));
  co_await write_all(socket, std::move(offer.bytes()), deadline, ctx);

  std::string proof = co_await read_n(socket, 1 + 32, deadline, ctx);
  const auto kind = static_cast<std::uint8_t>(proof[0]);
  std::string refusal;
  if (version != protocol_version)
    refusal = "protocol version " + std::to_string(version) + ", server speaks " +
              std::to_string(protocol_version);
  else if (peer.purpose != config.purpose)
    refusal = "this port serves '" + config.purpose + "', not '" + peer.purpose + "'";
  else if (auth) {
    digest seen{};
    copy_into(seen, std::string_view(proof).substr(1));
    digest expected =
        hmac_sha256(config.token, proof_message("dcomm-client", config.purpose, nonce_s, nonce_c));
    if (kind != proof_mac)
      refusal = "a job token is required and the client has none";
    else if (!digest_equal(expected, seen))
      refusal = "the client could not prove it holds the job token";
  } else if (kind == proof_refuses_server) {
    refusal = std::string("the client holds a job token and this ") +
              (config.rank >= 0 ? "rank" : "server") +
              " has none (set the same DCOMM_JOB_TOKEN on every rank)";
  }
  if (refusal.empty() && admit) refusal = admit(peer);
  wire_writer verdict;
  verdict.u8(refusal.empty() ? 1 : 0).str(refusal);
  digest mac_s{};
  if (refusal.empty() && auth)
    mac_s =
        hmac_sha256(config.token, proof_message("dcomm-server", config.purpose, nonce_c, nonce_s));
  verdict.raw(as_view(mac_s));
  if (refusal.empty()) {
    co_await write_all(socket, std::move(verdict.bytes()), deadline, ctx);
    co_return peer;
  }
  // Refused: the reason goes to the client if it still listens (one that
  // left, e.g. after refusing us, may not), and to our caller regardless.
  try {
    co_await write_all(socket, std::move(verdict.bytes()), deadline, ctx);
  } catch (const std::exception&) {
  }
  ctx.detail = refusal;
  throw error(errc::auth_failed, ctx);
}

}  // namespace dcomm::detail

// Separate compilation (tools/separate_compilation.py writes this block).
// clang-format off
DCOMM_INSTANTIATE(auto dcomm::detail::handshake_detail::write_all<void>(ip_tcp::socket& socket, std::string bytes, detail::clock::time_point deadline, const error_context& ctx) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::detail::handshake_detail::read_n<void>(ip_tcp::socket& socket, std::size_t n, detail::clock::time_point deadline, const error_context& ctx) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::detail::handshake_detail::send_bare_proof<void>(ip_tcp::socket& socket, std::uint8_t kind, detail::clock::time_point deadline, const error_context& ctx) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::detail::handshake_detail::read_offer<void>(ip_tcp::socket& socket, detail::clock::time_point deadline, const error_context& ctx) -> asio::awaitable<std::string>)
DCOMM_INSTANTIATE(auto dcomm::detail::handshake_detail::client_steps<void>(ip_tcp::socket& socket, const handshake_config& config, const std::string& address, detail::clock::time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::detail::client_handshake<void>(ip_tcp::socket& socket, const handshake_config& config, std::string address, detail::clock::time_point deadline) -> asio::awaitable<void>)
DCOMM_INSTANTIATE(auto dcomm::detail::server_handshake<void>(ip_tcp::socket& socket, const handshake_config& config, std::string peer_address, detail::clock::time_point deadline, handshake_admit admit) -> asio::awaitable<handshake_peer>)
// clang-format on
// End of the separate-compilation block.
