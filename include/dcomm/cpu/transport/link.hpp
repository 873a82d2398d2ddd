// One peer's connection as the transport sees it (cpu/transport/transport.hpp): the
// frames waiting to be written, the receives posted for its messages, the
// messages that came before their receive, the stage its frames are parsed
// from, and how it ended (a goodbye, a loss).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dcomm/cpu/transport/io_items.hpp"
#include "dcomm/cpu/transport/pool.hpp"
#include "dcomm/cpu/wire_format.hpp"
#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/socket.hpp"
#include "dcomm/shm/channel.hpp"

namespace dcomm::cpu {

// A send from here that a receive of the peer refused (sizes or dtypes
// differ) after the send had completed (an eager message is done once
// written): the peer's fail frame says so, and the next operation here
// that waits on the peer, or posts a message to it, fails with
// errc::mismatch naming the send (cpu/transport/impl/failure_forwarding.hpp).
struct refused_send {
  std::uint64_t group = 0;
  std::uint64_t tag = 0;
  std::uint64_t sent = 0;          // bytes the send had
  dtype sent_type = dtype::uint8;  // and their dtype
  std::uint64_t expected = 0;      // bytes the receive expected
  call_signature receive{};        // the receive's dtype and count
};

// A frame waiting to be written to a link (a header, and for eager and
// data frames the payload it points to).
struct outgoing_frame {
  wire_header header{};
  const void* payload = nullptr;
  std::size_t bytes = 0;
  io_item* item = nullptr;  // the send whose payload this is (eager, data)
  bool cancelled = false;   // taken back before it was written: skipped
  // A payload the frame owns (a fail frame's, which outlives the failed
  // call that made it): `payload` points into it.
  std::shared_ptr<const std::string> owned{};
};
// An eager message or rts that arrived before its receive was posted.
// Recycled with its payload buffer (at most eager_limit bytes).
struct unexpected_msg {
  wire_header header{};
  std::unique_ptr<std::byte[]> payload;
  std::size_t capacity = 0;

  std::byte* reserve(std::size_t n) {
    if (capacity < n) {
      // Powers of two from 1 KiB: few regrowths as sizes vary.
      capacity = std::max<std::size_t>(std::bit_ceil(n), 1024);
      payload = std::make_unique_for_overwrite<std::byte[]>(capacity);
    }
    return payload.get();
  }
};
// The connection to one peer, and everything waiting on it.
struct peer_link {
  explicit peer_link(detail::ip_tcp::socket s) : socket(std::move(s)) {}
  detail::ip_tcp::socket socket;
  std::string address;
  // The peer's steady clock is this far behind this rank's (0 on one
  // boot): what moves the times its frames tell onto this rank's clock.
  std::int64_t clock_offset_ns = 0;
  bool lost = false;
  std::string why;
  // The peer's goodbye: it left in order, after `bye_reason` caused by
  // rank `bye_culprit` (-1: none; it simply finished).
  bool shut = false;  // close(): shut for sending, waiting for the acknowledgements
  bool said_bye = false;
  bool socket_bye_sent = false;  // a shared memory link's, on its socket
  fail_reason bye_reason = fail_reason::none;
  int bye_culprit = -1;
  // Receiving. Lists in arrival or posting order, searched from the
  // front: a message matches the oldest receive with its key, and the
  // match is nearly always at the front (MPI's queues work the same way).
  std::vector<io_item*> posted;
  std::vector<unexpected_msg*> unexpected;  // from the transport's pool
  std::vector<io_item*> awaiting_data;      // receives that sent cts
  std::vector<char> stage;
  std::size_t begin = 0, end = 0;
  io_item* reading = nullptr;  // the receive whose buffer a read targets
  // Sending.
  fifo<outgoing_frame> frames;
  std::size_t batch = 0;               // frames at the front being written
  std::vector<io_item*> awaiting_cts;  // sends that sent rts
  // Frame bytes (headers included) written to this link so far, and those
  // of the batch being written (cpu_backend::bytes_sent_to).
  std::uint64_t bytes_written = 0;
  // Bytes read from this peer's memory in one copy (process_vm_readv:
  // large messages, all_reduces; cpu_backend::bytes_read_directly_from).
  std::uint64_t bytes_read_directly = 0;
  std::size_t batch_bytes = 0;
  // The batch's headers, copied: frames may move while it is written.
  std::vector<wire_header> batch_headers;
  std::vector<asio::const_buffer> gather;
  // A send of ours this peer refused after it completed: reported by the
  // next operation that needs this peer.
  std::optional<refused_send> refused;
  // A peer on this host: frames go through shared memory, and the socket
  // only tells when the peer is gone (cpu/transport/impl/shm_links.hpp).
  std::unique_ptr<shm::channel> shm;
  // The timer the reader waits on for bytes (its own, in its frame: an I/O
  // object must not outlive its io_context, and the transport may).
  asio::steady_timer* shm_wake = nullptr;
  bool shm_reader_waiting = false;
  // The reader waits for a frame's header, not for a payload: the eager
  // frames the ring holds whole may be handled without it
  // (transport::read_eager_inline).
  bool shm_between_frames = false;
  bool shm_writer_blocked = false;    // the ring was full
  bool shm_peer_gone = false;         // what its ring holds is all there will be
  std::size_t shm_frame_written = 0;  // of the front frame, its header included
  std::size_t shm_local = 0;          // the peer's place in the segment
  // Whether this rank may read the peer's memory (shm/single_copy.hpp).
  enum class direct_reads : std::uint8_t { untried, allowed, refused };
  direct_reads shm_direct = direct_reads::untried;
  // What an arena step waits to have read from the ring before it ends
  // (transport::arena_rings_read).
  std::uint64_t shm_read_before_step = 0;
};

}  // namespace dcomm::cpu
