// The transport's receiving side: posting receives, one reader per peer
// parsing frames out of a stage, and matching each message to its receive
// by (collective?, group, tag or sequence number, step), or keeping it as
// unexpected until the receive is posted. Part of cpu/transport/transport.hpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>

#include "dcomm/cpu/transport/transport.hpp"

namespace dcomm::cpu {

// Starts the readers, the links' own work and the doorbell's listener.
DCOMM_DECL void transport::start() {
  const detail::ignore_end none;
  for (int p = 0; p < world_; ++p)
    if (p != rank_) detail::start(ex_, reader(shared_from_this(), p), none);
  for (int p = 0; p < world_; ++p)
    if (p != rank_) links_[static_cast<std::size_t>(p)]->link->start();
  if (shm_) detail::start(ex_, listen_bell(shared_from_this()), none);
}

// Posting a receive: it takes a message that came first, or waits in the
// link's posted list (a send from here the peer refused fails it first).
DCOMM_DECL void transport::post_recv(io_item& it) {
  it.id = ++next_id_;
  if (report_refused_send(it)) return;
  peer_link& l = *links_[static_cast<std::size_t>(it.peer)];
  it.op->carried |= l.link->abilities.carries;
  // Before the lost check: a peer that sent its last message and left
  // is no error for the receive that message was for.
  auto u = std::find_if(l.unexpected.begin(), l.unexpected.end(),
                        [&](auto& m) { return key_of(m->header) == it.key; });
  if (u != l.unexpected.end()) {
    unexpected_msg* msg = *u;
    l.unexpected.erase(u);
    const wire_header h = msg->header;
    const bool fits = check_match(it, h);
    if (fits && h.kind == msg_kind::eager && it.bytes)
      std::memcpy(it.recv_buffer, msg->payload.get(), it.bytes);
    unexpected_.give_back(msg);
    if (!fits) return;
    if (h.kind == msg_kind::rts) {
      if (l.lost) return fail_item(it, lost_error(*it.op, it.peer));
      return start_data(l, it, h);
    }
    return complete(it);
  }
  if (l.lost) return fail_item(it, lost_error(*it.op, it.peer));
  it.state = item_state::posted;
  l.posted.push_back(&it);
}

// A message from it.peer arrived for a posted receive: does it fit? A
// collective's message carries its call's whole signature; a send's, its
// dtype and count: the dtype must be the receive's too (as torch asks: a
// uint8 buffer is no wildcard), and the size, which then says the count.
DCOMM_DECL bool transport::check_match(io_item& it, const wire_header& h) {
  const bool same_call = h.collective ? h.sig == it.sig : h.sig.type == it.sig.type;
  if (same_call && h.bytes == it.bytes) {
    // What the sender knew of the call's arrivals (detail/arrivals.hpp).
    if (h.collective)
      it.op->arrivals.merge(detail::arrivals_of(
          h.arrivals, links_[static_cast<std::size_t>(it.peer)]->clock_offset_ns));
    return true;
  }
  std::string detail;
  if (h.collective && !same_call)
    detail = "ranks called different collectives: rank " + std::to_string(it.peer) + " called " +
             describe(h.sig) + ", this rank called " + describe(it.sig);
  else
    detail = std::string(p2p_mismatch(h.sig.type, h.bytes, it.sig.type, it.bytes)) + ": rank " +
             std::to_string(it.peer) + " sent " + describe_message(h.sig.type, h.bytes) +
             ", this rank expects " + describe_message(it.sig.type, it.bytes) +
             (h.bytes != it.bytes ? " (a receive never truncates)" : "");
  auto e = make_error(errc::mismatch, *it.op, "rank " + std::to_string(it.peer), detail,
                      peer_address(it.peer));
  note_cause(fail_reason::mismatch, it.peer);
  it.op->culprit = it.peer;
  fail_item(it, e);
  if (h.collective) {
    // abandon() tells the group, naming both calls
    remember_mismatch(h.group, h.seq, it.peer, it.sig, h.sig);
  } else {
    // Tell the sender, so its send fails now rather than at its deadline,
    // or if it completed already (an eager message), its next operation
    // with this rank: bytes and sig say what this receive expected, cookie2
    // and extra what the send had (bytes, dtype), so that the sender can
    // name it.
    wire_header f = h;
    f.kind = msg_kind::fail;
    f.sig = it.sig;
    f.bytes = it.bytes;
    f.cookie = static_cast<std::uint64_t>(fail_reason::mismatch);
    f.cookie2 = h.bytes;
    f.extra = static_cast<std::uint32_t>(h.sig.type);
    links_[static_cast<std::size_t>(it.peer)]->frames.push_back({f, nullptr, 0, nullptr});
    start_write(it.peer);
  }
  return false;
}

// A large receive found its rts: read the data from the sender's buffer
// where it offered it (a peer of this host), else ask for it.
DCOMM_DECL void transport::start_data(peer_link& l, io_item& it, const wire_header& rts) {
  if (rts.cookie2 && l.link->read_offered(it.recv_buffer, it.bytes, rts)) {
    wire_header c = rts;
    c.kind = msg_kind::cts;
    c.cookie2 = it.id;
    c.extra = 1;  // read: no data frame
    l.frames.push_back({c, nullptr, 0, nullptr});
    start_write(it.peer);
    it.arrived = it.bytes;
    return complete(it);
  }
  it.state = item_state::awaiting_data;
  l.awaiting_data.push_back(&it);
  wire_header c = rts;
  c.kind = msg_kind::cts;
  c.cookie = rts.cookie;
  c.cookie2 = it.id;
  l.frames.push_back({c, nullptr, 0, nullptr});
  start_write(it.peer);
}

DCOMM_DECL io_item* transport::take_posted(peer_link& l, const match_key& key) {
  auto p =
      std::find_if(l.posted.begin(), l.posted.end(), [&](io_item* i) { return i->key == key; });
  if (p == l.posted.end()) return nullptr;
  io_item* it = *p;
  l.posted.erase(p);
  return it;
}

// A collective message no receive was posted for: kept for its receive,
// unless its call failed here already (then nobody will want it), or
// this rank is in that call and made a different one (a mismatch,
// whatever the message's step: algorithms of different calls need not
// use the same steps).
DCOMM_DECL bool transport::keep_unexpected(int peer, const wire_header& h) {
  if (failed_calls_.contains(call_id{h.group, h.seq}) || groups_.revoked(h.group)) return false;
  op_state* op = active_call(h.group, h.seq);
  if (!op) return true;
  if (op->failure) return false;
  if (!(h.sig == op->sig)) {
    mismatched_call(*op, peer, h.sig);
    return false;
  }
  return true;
}

// Takes n payload bytes from the stage if it holds them all (dst ==
// nullptr: discards them).
DCOMM_DECL bool transport::from_stage(peer_link& l, void* dst, std::size_t n) {
  if (l.end - l.begin < n) return false;
  if (dst && n) std::memcpy(dst, l.stage.data() + l.begin, n);
  l.begin += n;
  return true;
}

// Reading: one coroutine per peer parses frames out of a staging buffer;
// payloads for posted receives go straight into the receiver's buffer.
// `exact`: read no further than n bytes, so that a large payload behind
// them is left in the link for read_payload to read straight into its
// buffer instead of through the stage (a copy of half of each chunk).
DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> transport::fill(peer_link& l, std::size_t n,
                                                                bool exact) {
  if (l.end - l.begin >= n) co_return;
  if (l.begin > 0) {
    std::memmove(l.stage.data(), l.stage.data() + l.begin, l.end - l.begin);
    l.end -= l.begin;
    l.begin = 0;
  }
  while (l.end < n) {
    const std::size_t room = (exact ? n : l.stage.size()) - l.end;
    char* to = l.stage.data() + l.end;
    std::size_t got = l.link->read_now(to, room);
    if (got == 0) got = co_await l.link->read(to, room, false);
    l.end += got;
  }
}

// Reads n payload bytes into dst (nullptr: discard them).
DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> transport::read_payload(peer_link& l, char* dst,
                                                                        std::size_t n) {
  for (;;) {
    std::size_t take = std::min(n, l.end - l.begin);
    if (dst && take) std::memcpy(dst, l.stage.data() + l.begin, take);
    l.begin += take;
    n -= take;
    if (dst) dst += take;
    if (n == 0) co_return;
    // Straight into dst, no stage between: any size where reads are cheap
    // (a ring), else a payload large enough to be worth a read of its own.
    if (l.link->abilities.cheap_reads || (dst && n >= l.stage.size() / 4)) {
      co_await l.link->read(dst, n, true);
      co_return;
    }
    co_await fill(l, std::min(n, l.stage.size()));
  }
}

DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> transport::reader(std::shared_ptr<transport> self,
                                                                  int peer) {
  peer_link& l = *self->links_[static_cast<std::size_t>(peer)];
  std::string why;
  try {
    co_await self->read_frames(l, peer);
  } catch (const dcomm::error& e) {
    why = e.what();
  } catch (const std::system_error& e) {
    if (e.code() != asio::error::eof)
      why = "reading from it failed: " + e.code().message();
    else if (!l.said_bye)
      why =
          "it closed the connection without a goodbye (killed, crashed, or exited without "
          "closing dcomm)";
    else if (l.bye_reason == fail_reason::none)
      why = "it closed the connection (finished: destroyed its communicator or exited)";
    else
      why = std::string("it left after ") + describe(l.bye_reason) + " in a call";
  } catch (const std::exception& e) {
    why = std::string("reading from it failed: ") + e.what();
  }
  if (l.reading) {
    io_item* it = l.reading;
    l.reading = nullptr;
    it->in_flight = false;
    it->op->wake();
  }
  if (!l.lost) self->lose_link(peer, why);
}

// One frame after another, in one coroutine frame: a nested coroutine
// per message would allocate (Asio recycles few frames per thread), so
// the helpers are awaited only when the stage cannot serve the bytes; what
// needs no waiting is in plain functions (below).
DCOMM_EMIT_ON_USE_DEFINITION detail::task<void> transport::read_frames(peer_link& l, int peer) {
  for (;;) {
    // While a large payload is due (we sent cts), read headers on their own:
    // one more small read per frame, one copy less per payload byte.
    if (l.end - l.begin < sizeof(wire_header)) {
      l.between_frames = true;
      co_await fill(l, sizeof(wire_header), !l.awaiting_data.empty());
      l.between_frames = false;
    }
    const wire_header h = take_header(l, peer);
    switch (h.kind) {
      case msg_kind::eager:
      case msg_kind::data: {
        const payload_target t =
            h.kind == msg_kind::eager ? eager_target(l, peer, h) : data_target(l, h);
        if (t.item) {
          if (from_stage(l, t.dst, h.bytes))
            t.item->arrived += h.bytes;
          else if (!co_await read_into(l, *t.item, h.bytes))
            break;  // cancelled meanwhile
          if (h.kind == msg_kind::eager)
            complete(*t.item);
          else
            data_arrived(l, *t.item);
          break;
        }
        if (!from_stage(l, t.dst, h.bytes)) co_await read_payload(l, t.dst, h.bytes);
        if (t.msg) file_unexpected(l, t.msg);
        break;
      }
      case msg_kind::fail: {
        // A collective's may carry the other call of a mismatch, then the
        // finding of the rank that found the failure (wire_format.hpp).
        call_signature theirs{};
        const std::size_t payload = h.collective ? h.bytes : 0;
        const bool readable = payload <= sizeof theirs + max_finding_bytes && h.extra <= payload;
        const std::size_t said = readable ? h.extra : 0;
        const bool carries = readable && payload - said == sizeof theirs;
        std::string finding(said, '\0');
        if (!from_stage(l, carries ? &theirs : nullptr, payload - said))
          co_await read_payload(l, carries ? reinterpret_cast<char*>(&theirs) : nullptr,
                                payload - said);
        if (!from_stage(l, finding.data(), said)) co_await read_payload(l, finding.data(), said);
        on_fail_frame(peer, h, carries ? &theirs : nullptr, std::move(finding));
        break;
      }
      case msg_kind::revoke: {
        // Why, in the revoker's words (cut short past max_finding_bytes).
        const std::size_t said = std::min<std::uint64_t>(h.bytes, max_finding_bytes);
        std::string why(said, '\0');
        if (!from_stage(l, why.data(), said)) co_await read_payload(l, why.data(), said);
        if (!from_stage(l, nullptr, h.bytes - said))
          co_await read_payload(l, nullptr, h.bytes - said);
        on_revoke(peer, h, std::move(why));
        break;
      }
      case msg_kind::agree: {
        // Bounded by the world's size (agreements.hpp); a longer one is dropped.
        const bool fits = h.bytes <= max_agree_payload(world_);
        std::string bytes(fits ? h.bytes : 0, '\0');
        if (!from_stage(l, fits ? bytes.data() : nullptr, h.bytes))
          co_await read_payload(l, fits ? bytes.data() : nullptr, h.bytes);
        if (fits) on_agree_frame(peer, h, bytes);
        break;
      }
      default:
        on_control_frame(l, peer, h);
    }
  }
}

// The next frame's header, from the stage (which holds it).
DCOMM_DECL wire_header transport::take_header(peer_link& l, int peer) const {
  wire_header h;
  std::memcpy(&h, l.stage.data() + l.begin, sizeof h);
  l.begin += sizeof h;
  if (h.magic != wire_magic || h.kind < msg_kind::eager || h.kind > msg_kind::agree)
    throw_error(errc::protocol_error,
                {.operation = "tcp transport",
                 .rank = rank_,
                 .peers = "rank " + std::to_string(peer),
                 .detail = "a frame that is not dcomm's (different dcomm versions?)"});
  return h;
}

// An eager message: for the oldest receive posted with its key (refused if
// it does not fit), else kept until one is posted, unless it is a
// collective's that nobody will want (keep_unexpected).
DCOMM_DECL transport::payload_target transport::eager_target(peer_link& l, int peer,
                                                             const wire_header& h) {
  if (io_item* it = take_posted(l, key_of(h))) {
    if (!check_match(*it, h)) return {};  // refused
    return {static_cast<char*>(it->recv_buffer) + it->arrived, it, nullptr};
  }
  if (h.collective && !keep_unexpected(peer, h)) return {};
  unexpected_msg* msg = unexpected_.take();
  msg->header = h;
  return {reinterpret_cast<char*>(msg->reserve(h.bytes)), nullptr, msg};
}

// An eager message read into `msg`: a receive may have been posted while
// its payload was read; else it waits for one.
DCOMM_DECL void transport::file_unexpected(peer_link& l, unexpected_msg* msg) {
  const wire_header& h = msg->header;
  if (io_item* late = take_posted(l, key_of(h))) {
    if (check_match(*late, h)) {
      if (late->bytes) std::memcpy(late->recv_buffer, msg->payload.get(), late->bytes);
      complete(*late);
    }
    unexpected_.give_back(msg);
    return;
  }
  l.unexpected.push_back(msg);
}

// A data frame: the whole payload, or a staged send's next part (at offset
// cookie2), for the receive that sent cts; dropped if that receive was
// cancelled.
DCOMM_DECL transport::payload_target transport::data_target(peer_link& l, const wire_header& h) {
  auto found = std::find_if(l.awaiting_data.begin(), l.awaiting_data.end(),
                            [&](io_item* i) { return i->id == h.cookie; });
  if (found == l.awaiting_data.end() || h.cookie2 != (*found)->arrived ||
      h.bytes > (*found)->bytes - (*found)->arrived)
    return {};
  io_item* it = *found;
  return {static_cast<char*>(it->recv_buffer) + it->arrived, it, nullptr};
}

// A data frame arrived for `it`: done once all of it has.
DCOMM_DECL void transport::data_arrived(peer_link& l, io_item& it) {
  if (it.arrived == it.bytes) {
    std::erase(l.awaiting_data, &it);
    complete(it);
  } else if (it.progress) {
    it.op->wake();
  }
}

// The frames without a payload to read: rts, cts, probe, probe_reply, bye.
DCOMM_DECL void transport::on_control_frame(peer_link& l, int peer, const wire_header& h) {
  switch (h.kind) {
    case msg_kind::rts:
      return on_rts(l, peer, h);
    case msg_kind::cts:
      return on_cts(l, peer, h);
    case msg_kind::probe: {
      wire_header reply = h;
      reply.kind = msg_kind::probe_reply;
      reply.cookie = static_cast<std::uint64_t>(progress_of(h.group, h.seq));
      tell_whereabouts(h.group, reply);
      l.frames.push_back({reply, nullptr, 0, nullptr});
      return start_write(peer);
    }
    case msg_kind::probe_reply:
      return on_probe_reply(peer, h);
    case msg_kind::bye:
      l.said_bye = true;
      std::tie(l.bye_reason, l.bye_culprit) = read_goodbye(h, world_);
      return;
    default:
      return;
  }
}

// A large message is announced: ask for its data if its receive is posted,
// else keep the announcement for the receive.
DCOMM_DECL void transport::on_rts(peer_link& l, int peer, const wire_header& h) {
  io_item* it = take_posted(l, key_of(h));
  if (it) {
    if (check_match(*it, h)) start_data(l, *it, h);
  } else if (!h.collective || keep_unexpected(peer, h)) {
    unexpected_msg* msg = unexpected_.take();
    msg->header = h;
    l.unexpected.push_back(msg);
  }
}

// The receiver of a large send is ready: its data goes (a staged send's,
// part by part as they become ready).
DCOMM_DECL void transport::on_cts(peer_link& l, int peer, const wire_header& h) {
  auto found = std::find_if(l.awaiting_cts.begin(), l.awaiting_cts.end(),
                            [&](io_item* i) { return i->id == h.cookie; });
  if (found == l.awaiting_cts.end()) return;  // that send was cancelled
  io_item* it = *found;
  l.awaiting_cts.erase(found);
  if (h.extra == 1 && it->offered) {  // the receiver read the buffer itself
    complete(*it);
    return it->op->wake();
  }
  if (it->staged) {
    it->peer_id = h.cookie2;
    it->state = item_state::queued;
    return queue_parts(*it);
  }
  wire_header d = header_for(*it);
  d.kind = msg_kind::data;
  d.cookie = h.cookie2;
  it->state = item_state::queued;
  l.frames.push_back({d, it->send_buffer, it->bytes, it});
  start_write(peer);
}

// Reads `bytes` of payload to the receive's buffer at it.arrived, in
// pieces (with it.progress, of that size, waking the op after each). A
// receive cancelled meanwhile (its call failed) has the rest read and
// dropped, so the link stays in step; false then: `it` is no longer ours.
DCOMM_EMIT_ON_USE_DEFINITION detail::task<bool> transport::read_into(peer_link& l, io_item& it,
                                                                     std::size_t bytes) {
  it.in_flight = true;
  l.reading = &it;
  while (bytes) {
    if (it.state == item_state::failed) {
      l.reading = nullptr;
      it.in_flight = false;
      it.op->wake();
      co_await read_payload(l, nullptr, bytes);
      co_return false;
    }
    const std::size_t step = std::min(bytes, it.progress ? it.progress : read_piece);
    co_await read_payload(l, static_cast<char*>(it.recv_buffer) + it.arrived, step);
    it.arrived += step;
    bytes -= step;
    if (bytes && it.progress) it.op->wake();
  }
  l.reading = nullptr;
  it.in_flight = false;
  co_return true;
}

}  // namespace dcomm::cpu
