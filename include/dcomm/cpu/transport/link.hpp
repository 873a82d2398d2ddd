// One peer's connection as the transport sees it (cpu/transport/transport.hpp):
// the link, which carries frames to and from the peer (an interface: a
// socket, cpu/transport/socket_link.hpp, or a pair of shared memory rings,
// cpu/transport/shm_link.hpp), and the per-peer record that is the same for
// every kind of link: the frames waiting to be written, the receives posted
// for the peer's messages, the messages that came before their receive,
// the stage its frames are parsed from, and how it ended (a goodbye, a
// loss). Sending, receiving, failure forwarding and shutdown talk to the
// link only through the interface below, so a new kind of link touches
// none of them (docs/design.md, "Adding a link kind").
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dcomm/backend.hpp"
#include "dcomm/cpu/transport/io_items.hpp"
#include "dcomm/cpu/transport/pool.hpp"
#include "dcomm/cpu/wire_format.hpp"
#include "dcomm/detail/asio.hpp"
#include "dcomm/detail/task.hpp"

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

// The frames for one peer, in order. The first `batch` are the link's
// (being written: a socket's gathered write in progress, a frame half in a
// full ring); the transport appends behind them and, taking back a failed
// call's sends, only marks frames from `batch` on as cancelled.
struct send_queue {
  fifo<outgoing_frame> frames;
  std::size_t batch = 0;
};

// What a link tells the transport, which implements this. Called on the
// transport's strand, like every member of a link.
class link_events {
 public:
  virtual ~link_events() = default;
  // Keeps the transport (and so the link) alive in a handler that may run
  // after the transport's owner let go of it (a write in progress).
  virtual std::shared_ptr<link_events> keep_alive() = 0;
  // The first `frames` frames of the peer's queue are written (`bytes`
  // bytes, headers included), or writing them failed with `ec`: their sends
  // complete (or fail and the link is lost) and they leave the queue.
  virtual void written(int peer, std::size_t frames, std::size_t bytes,
                       const asio::error_code& ec) = 0;
  // Write what is queued for the peer (a link whose write ended goes on).
  virtual void write_queued(int peer) = 0;
  // The reader has handled every frame it read and waits for bytes (a
  // polled link's: what waits on those frames may look again).
  virtual void reader_idle() = 0;
  // A goodbye heard outside the frames (on the mesh's socket of a link
  // whose frames go elsewhere): it counts unless one came in the frames.
  virtual void heard_goodbye(int peer, const wire_header& bye) = 0;
  // The link failed outside a read or a write: everything that needs the
  // peer fails (transport::lose_link).
  virtual void lose(int peer, std::string why) = 0;
};

// What a kind of link can do beyond carrying frames in order.
struct link_abilities {
  // What calls over it count as carried by (op_report, the flight recorder).
  std::uint8_t carries = transports::tcp;
  // A read is a copy out of memory, not a system call: payloads are read
  // straight into their buffers in any size, never through the stage.
  bool cheap_reads = false;
  // Its bytes are found by polling (transport::spin_shm), not by the
  // reactor: an operation that waits on it polls before it sleeps.
  bool polled = false;
  // The peer shares this rank's host segment: a group whose members are
  // all so linked meets in an arena (cpu/algorithms/shm_arena.hpp).
  bool host_arena = false;
};

// A link to one peer. The transport owns it (in the peer's record) for as
// long as it lives, calls it on its strand, and never calls `write` on a
// lost link. Failures surface as a read that throws asio::system_error
// (asio::error::eof once the peer is gone and everything it wrote is
// read), as `written` with an error, or as `lose`.
class link {
 public:
  link(const link&) = delete;
  link& operator=(const link&) = delete;
  virtual ~link() = default;

  const link_abilities abilities;
  // Bytes read from this peer's memory in one copy (read_offered, the
  // arena's reads: cpu_backend::bytes_read_directly_from).
  std::uint64_t bytes_read_directly = 0;

  // Once, before anything else: whom it reports to, which peer it reaches
  // and the queue it writes from.
  void attach(link_events& owner, int peer, send_queue& queue) {
    owner_ = &owner;
    peer_ = peer;
    queue_ = &queue;
  }
  // Work of its own in the background, once the transport runs.
  virtual void start() {}

  // Writing. `write`: writes the queue's frames in order, as far as it can
  // now, and returns; each frame written is reported through `written`
  // (with its send's `in_flight` set while the link holds its bytes, so
  // that a failed call waits for it rather than hand its buffer back).
  virtual void write() = 0;
  // A large send's rts: offers the send's buffer for the peer to read
  // itself (says where in `rts`); false: its data will follow in frames.
  virtual bool offer(wire_header& /*rts*/, const void* /*buffer*/) { return false; }
  // An offered buffer goes back to its caller without the peer's answer.
  virtual void withdraw_offer() {}

  // Reading. `read_now`: up to n bytes that are there without waiting (0:
  // none, or a kind that only reads in `read`); dst == nullptr drops them.
  // `read`: waits for bytes, then reads at least one (all n if `all`).
  virtual std::size_t read_now(void* dst, std::size_t n) = 0;
  virtual detail::task<std::size_t> read(void* dst, std::size_t n, bool all) = 0;
  // A large message the peer offered (its rts, above): read into dst at
  // once; false: it did not (the peer asks for it the usual way).
  virtual bool read_offered(void* /*dst*/, std::size_t /*n*/, const wire_header& /*rts*/) {
    return false;
  }

  // Ending. `open`: not closed here. `shut_for_sending`: every frame is
  // written; the peer sees the end after `bye` (a goodbye the frames
  // carried already). `unacknowledged`: bytes written that the peer has
  // not taken yet. `close`: at once; `bye` (null where the link was lost)
  // for a peer that watches something other than the frames.
  virtual bool open() const = 0;
  virtual void shut_for_sending(const wire_header& bye) = 0;
  virtual std::size_t unacknowledged() = 0;
  virtual void close(const wire_header* bye) = 0;
  // Start-up failed here after the transport started: a peer still in
  // its own start-up watches only the mesh's socket; a link whose frames
  // go elsewhere sends `bye` there too.
  virtual void goodbye_to_mesh(const wire_header& /*bye*/) {}

 protected:
  explicit link(link_abilities a) : abilities(a) {}

  link_events* owner_ = nullptr;
  int peer_ = -1;
  send_queue* queue_ = nullptr;
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

// The transport's record of one peer, whatever its link: everything
// waiting on it. The frames to write are its send_queue (frames, batch).
struct peer_link : send_queue {
  explicit peer_link(std::unique_ptr<cpu::link> l) : link(std::move(l)) {}
  std::unique_ptr<cpu::link> link;
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
  // The reader waits for a frame's header, not for a payload: a polled
  // link's eager frames may be handled without it
  // (transport::read_eager_inline).
  bool between_frames = false;
  // Sending (the frames: send_queue).
  std::vector<io_item*> awaiting_cts;  // sends that sent rts
  // Frame bytes (headers included) written to this link so far
  // (cpu_backend::bytes_sent_to).
  std::uint64_t bytes_written = 0;
  // A send of ours this peer refused after it completed: reported by the
  // next operation that needs this peer.
  std::optional<refused_send> refused;
};

}  // namespace dcomm::cpu
