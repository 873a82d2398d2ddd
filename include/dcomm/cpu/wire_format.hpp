// The CPU backend's wire format: the fixed header every frame starts with,
// what each kind of frame does (msg_kind), and the call signature
// it carries, by which ranks that make different calls find out. The mesh
// uses it too: a rank that fails while the mesh forms says goodbye in it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <type_traits>

#include "dcomm/backend.hpp"
#include "dcomm/detail/arrivals.hpp"
#include "dcomm/dtype.hpp"
#include "dcomm/operation.hpp"
#include "dcomm/reduce_op.hpp"

namespace dcomm::cpu {

// What a collective was called with. Every message carries the sender's, so
// ranks that disagree fail with errc::mismatch instead of mixing data. (The
// whole of a call's identity, group id, sequence number, step and this
// signature, is stated in impl/call_identity.hpp.)
struct call_signature {
  // The operation the message belongs to: the collective the backend runs
  // (a broadcast_object's messages are broadcast's), send for point to
  // point (a receive matches the send's signature).
  operation op = operation::send;
  dtype type = dtype::uint8;
  reduce_kind reduce = reduce_kind::sum;
  std::uint8_t has_reduce = 0;
  std::int32_t root = -1;
  std::uint64_t count = 0;  // elements per rank; 0 for the _v forms
  // A CUDA tensor staged slice by slice runs the algorithm once per slice:
  // ranks must agree (0: the whole buffer at once).
  std::uint32_t slices = 0;
  // The algorithm asked for (op_options::algorithm, else DCOMM_ALGO's;
  // automatic: chosen by size, the same on every rank that agrees on the rest).
  dcomm::algorithm algo = dcomm::algorithm::automatic;
  // A rooted operation with its confirmation (call.hpp): ranks must agree.
  std::uint8_t confirmed = 0;
  // Runs in its group's arena (cpu/algorithms/shared_memory.hpp) rather
  // than by messages: ranks must agree (a CUDA tensor staged whole does not).
  std::uint8_t arena = 0;
  std::uint8_t reserved[1] = {};

  friend bool operator==(const call_signature&, const call_signature&) = default;
};

inline std::string describe(const call_signature& s) {
  if (s.op == operation::send) return "send/recv";
  std::string d = name(s.op);
  if (s.op == operation::barrier)
    return (s.algo == dcomm::algorithm::automatic
                ? d
                : d + "(" + std::string(dcomm::name(s.algo)) + ")") +
           (s.arena ? " in shared memory" : "");
  d += "(" + std::string(dcomm::name(s.type)) + " x " + std::to_string(s.count);
  if (s.has_reduce) d += ", " + std::string(dcomm::name(s.reduce));
  if (s.root >= 0) d += ", root " + std::to_string(s.root);
  if (s.algo != dcomm::algorithm::automatic) d += ", " + std::string(dcomm::name(s.algo));
  d += ")";
  if (s.slices) d += " staged from a CUDA tensor in " + std::to_string(s.slices) + " slices";
  const bool rooted = s.op == operation::broadcast || s.op == operation::reduce ||
                      s.op == operation::scatter || s.op == operation::gather;
  if (s.arena) d += " in shared memory";
  if (rooted && !s.confirmed) d += " without confirmation (confirm_rooted off)";
  return d;
}

// A point-to-point message as a mismatch names it: "40 bytes (float32 x 10)".
inline std::string describe_message(dtype type, std::uint64_t bytes) {
  const std::size_t element = size_of(type);
  return std::to_string(bytes) + " bytes (" + std::string(dcomm::name(type)) +
         (element ? " x " + std::to_string(bytes / element) : std::string()) + ")";
}

// What differs between a send and the receive that refused it.
inline const char* p2p_mismatch(dtype sent, std::uint64_t sent_bytes, dtype expected,
                                std::uint64_t expected_bytes) {
  if (sent == expected) return "message size mismatch";
  return sent_bytes == expected_bytes ? "dtype mismatch" : "dtype and size mismatch";
}

// The frames of the transport (cpu/transport/transport.hpp): a fixed
// wire_header, then `bytes` of payload (eager, data, and the control frames
// that say so):
//   eager  small message, payload follows; matched on arrival
//   rts    "ready to send" a large message: header only, matched on arrival
//   cts    the receiver's answer once a matching receive is posted
//   data   the large payload, sent after cts, read straight into the buffer;
//          a send whose data becomes ready in parts (a CUDA tensor copied
//          to the host slice by slice) sends one data frame per part, each
//          with its offset (cookie2), in order
//   fail   "your call did not match mine", or "this collective failed
//          here" (with what the rank that found it said of the cause): the
//          peer fails its call too, with that cause, and passes a
//          collective's failure on to the rest of the group; for a send
//          whose receive refused it (sizes differ), the send fails, or if it
//          completed already, the sender's next operation with the receiver
//   probe  sent by a rank whose collective reached its deadline: "where are
//          you in this call?"; answered at once by probe_reply (entered it,
//          done with it, or not yet there). A peer that does not answer is
//          stopped or hung: the timeout names it, not the ranks in between.
//   bye    the last frame before an orderly close, naming the failure that
//          made this rank leave (if any), so that its peers blame the first
//          cause and not the rank that left because of it
//   revoke the group (group) is revoked by rank cookie - 1, for the reason
//          in the payload: the receiver fails the group's operations and
//          its descendants' and tells the other members once
//          (cpu/transport/impl/revocation.hpp)
//   agree  a step of an agreement (seq: the group's agreement number;
//          cookie: which step; payload: cpu/transport/agreements.hpp)
enum class msg_kind : std::uint8_t {
  eager = 1,
  rts,
  cts,
  data,
  fail,
  probe,
  probe_reply,
  bye,
  revoke,
  agree,  // the last kind: a frame of a higher one is not dcomm's
};

// Why a fail or bye frame was sent (its cookie); cookie2 names the rank to
// blame, plus one (0: none known).
//
// A collective's fail frame may carry a payload of `bytes`: a mismatch's
// other call (a call_signature), then the finding of the rank that found
// the failure, in words (its last `extra` bytes: what a timeout's probe or
// shared memory said of the culprit, why a link was lost), so that every
// member's error gives the whole cause, not only whom to blame.
enum class fail_reason : std::uint64_t { none = 0, mismatch, peer_lost, timeout, other };

inline const char* describe(fail_reason r) {
  switch (r) {
    case fail_reason::mismatch:
      return "a mismatched call";
    case fail_reason::peer_lost:
      return "a lost peer";
    case fail_reason::timeout:
      return "a timeout";
    case fail_reason::other:
      return "a failed call";
    case fail_reason::none:
      break;
  }
  return "no failure";
}

// A finding longer than this is cut short in a fail frame (a probe's
// finding names every member that did not answer: bounded by the world's
// size, it is kept whole below a few hundred ranks).
inline constexpr std::size_t max_finding_bytes = 16 * 1024;

// Where a rank is in a collective, as a probe_reply says (its cookie).
enum class call_progress : std::uint64_t { not_entered = 1, in_call, finished };

// Where a rank is in the probed call's group, as a probe_reply also says:
// the oldest collective of the group it is in (cookie2: its sequence
// number plus one, 0 for none; sig: its signature; extra: milliseconds
// since the rank made it) and how many of the group's calls it has
// entered (bytes; a control frame has no payload).
struct group_whereabouts {
  std::uint64_t in_call = 0;  // sequence number + 1; 0: in none
  operation op = operation::send;
  std::uint32_t entered_ms_ago = 0;
  std::uint64_t calls_entered = 0;
};

inline constexpr std::uint32_t wire_magic = 0x314d4344;  // "DCM1" little-endian

// Ranks of one job run the same build on the same architecture: the header
// travels in native byte order; the magic catches anything else.
struct wire_header {
  std::uint32_t magic = wire_magic;
  msg_kind kind = msg_kind::eager;
  std::uint8_t collective = 0;
  std::uint16_t reserved = 0;
  call_signature sig{};
  std::uint64_t group = 0;
  std::uint64_t seq = 0;  // the tag (p2p) or the group's sequence number
  std::uint32_t step = 0;
  // rts over shared memory: the sender's count of withdrawn offers
  // (shm/single_copy.hpp); cts: 1 when the receiver read the payload itself;
  // fail for a send a receive refused: the send's dtype; a collective's fail:
  // the length of the finding its payload ends with.
  std::uint32_t extra = 0;
  std::uint64_t bytes = 0;    // payload size of the message (also in rts, cts)
  std::uint64_t cookie = 0;   // rts, cts: the sender's id; data: the receiver's id
  std::uint64_t cookie2 = 0;  // cts: the receiver's id; rts over shared memory: the
                              // sender's buffer, offered for a single copy (0: none)
  // A collective's eager and rts frames: when the call's ranks called it,
  // as far as the sender knew (detail/arrivals.hpp), on the sender's clock.
  detail::arrival_stamp arrivals{};
};
static_assert(std::is_trivially_copyable_v<wire_header>);

// The last frame before an orderly close: the sender leaves after `reason`,
// blaming `culprit` (-1: nobody known; reason none: it simply finished).
inline wire_header goodbye(fail_reason reason, int culprit) {
  wire_header b;
  b.kind = msg_kind::bye;
  b.cookie = static_cast<std::uint64_t>(reason);
  b.cookie2 = static_cast<std::uint64_t>(culprit + 1);
  return b;
}

// A goodbye's reason and culprit (-1: none, or not a rank of `world`).
inline std::pair<fail_reason, int> read_goodbye(const wire_header& h, int world) {
  const auto reason = h.cookie <= static_cast<std::uint64_t>(fail_reason::other)
                          ? static_cast<fail_reason>(h.cookie)
                          : fail_reason::other;
  const int culprit = h.cookie2 && h.cookie2 <= static_cast<std::uint64_t>(world)
                          ? static_cast<int>(h.cookie2) - 1
                          : -1;
  return {reason, culprit};
}

}  // namespace dcomm::cpu
