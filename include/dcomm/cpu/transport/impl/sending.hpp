// The transport's sending side: posting sends, queueing frames for a link
// (which writes them in order: cpu/transport/link.hpp), what is done once
// they are written, and taking back the items of a failed call. Part of
// cpu/transport/transport.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "dcomm/cpu/transport/transport.hpp"

namespace dcomm::cpu {

DCOMM_DECL wire_header transport::header_for(const io_item& it) const {
  wire_header h;
  h.collective = it.key.collective;
  h.sig = it.sig;
  h.group = it.key.group;
  h.seq = it.key.seq;
  h.step = it.key.step;
  h.bytes = it.bytes;
  if (it.key.collective) h.arrivals = detail::stamp_of(it.op->arrivals);
  return h;
}

// Posting a send: a small one goes as one eager frame, a large (or staged)
// one is announced by rts and waits for the receiver's cts.
DCOMM_DECL void transport::post_send(io_item& it) {
  it.id = ++next_id_;
  if (report_refused_send(it)) return;
  peer_link& l = *links_[static_cast<std::size_t>(it.peer)];
  if (l.lost) return fail_item(it, lost_error(*it.op, it.peer));
  it.op->carried |= l.link->abilities.carries;
  wire_header h = header_for(it);
  if (it.bytes <= options_.eager_limit && !it.staged) {
    h.kind = msg_kind::eager;
    it.state = item_state::queued;
    l.frames.push_back({h, it.send_buffer, it.bytes, &it});
  } else {
    h.kind = msg_kind::rts;
    h.cookie = it.id;
    // The link may let the peer read the buffer itself (a peer of this
    // host: shm/single_copy.hpp).
    if (!it.staged && it.bytes && l.link->offer(h, it.send_buffer)) it.offered = true;
    it.state = item_state::awaiting_cts;
    l.awaiting_cts.push_back(&it);
    l.frames.push_back({h, nullptr, 0, nullptr});
  }
  start_write(it.peer);
}

// A staged send's first `ready` bytes may go (posted with it.staged; the
// parts are sent in order, once the receiver has answered).
DCOMM_DECL void transport::send_ready(io_item& it, std::size_t ready) {
  it.ready = std::min(ready, it.bytes);
  if (it.state == item_state::queued) queue_parts(it);
}

// The data frames of a staged send's ready bytes not handed out yet.
DCOMM_DECL void transport::queue_parts(io_item& it) {
  if (it.queued >= it.ready || it.finished()) return;
  if (links_[static_cast<std::size_t>(it.peer)]->lost)
    return fail_item(it, lost_error(*it.op, it.peer));
  wire_header d = header_for(it);
  d.kind = msg_kind::data;
  d.cookie = it.peer_id;
  d.cookie2 = it.queued;
  d.bytes = it.ready - it.queued;
  links_[static_cast<std::size_t>(it.peer)]->frames.push_back(
      {d, static_cast<const char*>(it.send_buffer) + it.queued, d.bytes, &it});
  it.queued = it.ready;
  start_write(it.peer);
}

// Writing: the link writes what is queued, in order, as far as it can now
// (a link that is writing already goes on by itself).
DCOMM_DECL void transport::start_write(int peer) {
  peer_link& l = *links_[static_cast<std::size_t>(peer)];
  if (l.lost) return;
  l.link->write();
}

// The link wrote the first `frames` frames (or failed to): their sends are
// done, unless a staged send has parts to come.
DCOMM_DECL void transport::written(int peer, std::size_t frames, std::size_t bytes,
                                   const asio::error_code& ec) {
  peer_link& l = *links_[static_cast<std::size_t>(peer)];
  for (std::size_t i = 0; i < frames; ++i) {
    io_item* it = l.frames[i].item;
    if (!it) continue;
    it->in_flight = false;
    it->written += l.frames[i].bytes;
    if (ec)
      fail_item(*it, lost_error(*it->op, peer));
    else if (!it->finished() && (!it->staged || it->written == it->bytes))
      complete(*it);
    it->op->wake();  // also when its op is draining
  }
  l.frames.pop_front(frames);
  l.batch = 0;
  if (!ec) l.bytes_written += bytes;
  if (ec && !l.lost) lose_link(peer, "writing to it failed: " + ec.message());
}

// A send whose buffer the peer may be reading leaves awaiting_cts without
// its answer (its call failed, the link closed): the link says so before
// the buffer goes back to the caller.
DCOMM_DECL void transport::withdraw_offer(peer_link& l, io_item& it) {
  if (it.offered) l.link->withdraw_offer();
  it.offered = false;
}

// Takes back an item of a failed op. I/O in progress on its buffer can
// only be stopped by closing the link (the stream would be out of step).
DCOMM_DECL void transport::cancel_item(io_item& it, bool let_io_finish) {
  if (it.finished() && !it.in_flight) return;
  peer_link& l = *links_[static_cast<std::size_t>(it.peer)];
  switch (it.state) {
    case item_state::posted:
      std::erase(l.posted, &it);
      break;
    case item_state::awaiting_data:
      std::erase(l.awaiting_data, &it);
      break;
    case item_state::awaiting_cts:
      std::erase(l.awaiting_cts, &it);
      withdraw_offer(l, it);
      break;
    case item_state::queued:
      // Marked, not erased: cheaper, and the frames of the write in
      // progress are counted by position. A staged send may have several.
      for (std::size_t i = l.batch; i < l.frames.size(); ++i)
        if (l.frames[i].item == &it) {
          l.frames[i].cancelled = true;
          l.frames[i].item = nullptr;
          if (!it.staged) break;
        }
      break;
    default:
      break;
  }
  // I/O in progress on the item's buffer: a send being written finishes
  // on its own, a receive being read drops the rest of its payload
  // (read_into); abandon waits for either (`let_io_finish`). Otherwise
  // only closing the link stops it (the stream would be out of step).
  if (it.in_flight && !let_io_finish) {
    if (!l.lost)
      lose_link(it.peer, "closed after rank " + std::to_string(rank_) +
                             "'s call failed in the middle of a message");
  }
  if (!it.finished()) it.state = item_state::failed;
}

}  // namespace dcomm::cpu
