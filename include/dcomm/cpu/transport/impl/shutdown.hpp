// The transport's shutdown: abort (fail everything, close every link), an
// orderly close (fail what is pending, say goodbye, drain what is queued,
// close once the peer has every byte), and the loss of one link. Part of
// cpu/transport/transport.hpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "dcomm/cpu/transport/transport.hpp"

namespace dcomm::cpu {

// Fails every pending and future operation; closes every link (after a
// goodbye, if it can go out at once).
DCOMM_DECL void transport::abort() {
  if (aborted_) return;
  const bool was_closed = closed_;
  aborted_ = true;
  if (!was_closed) say_goodbye();
  for (auto& l : links_) close_link(*l);
  // fail_op only marks and wakes: the list does not change under us.
  for (op_state* op = ops_; op; op = op->next_op)
    fail_op(*op, make_error(errc::aborted, *op, {}, "the communicator was aborted"));
}

// The communicator was destroyed: fail what is still pending, and close
// every link in order. What is queued (the fail frames of a call that just
// failed among it) goes out first, then a goodbye naming the first failure
// this rank saw; then the link is shut for sending and closed once the
// peer has acknowledged every byte. (Closing with bytes unsent, or with
// the peer's bytes unread, would reset the connection and lose them.) A
// link still busy after `close_grace` is cut. `closed` runs once every
// link is closed.
DCOMM_DECL void transport::close(std::function<void()> closed) {
  if (closed_ || aborted_) {
    if (closed) closed();
    return;
  }
  closed_ = true;
  on_closed_ = std::move(closed);
  for (op_state* op = ops_; op; op = op->next_op)
    fail_op(*op, make_error(errc::closed, *op, {}, "the communicator was destroyed"));
  say_goodbye();
  // Owned by its handler, not by the transport: a timer must not outlive
  // its io_context, and the transport may.
  auto timer = std::make_shared<asio::steady_timer>(ex_);
  close_timer_ = timer;
  drain(timer, detail::clock::now() + close_grace);
}

// One step of close(): every millisecond until each link is closed.
DCOMM_DECL void transport::drain(const std::shared_ptr<asio::steady_timer>& timer,
                                 detail::clock::time_point cut) {
  const bool late = detail::clock::now() >= cut;
  bool open = false;
  for (auto& l : links_) {
    if (!l->link->open()) continue;
    if (l->batch == 0 && l->frames.empty()) {
      if (!l->shut) l->link->shut_for_sending(goodbye(first_reason_, first_culprit_));
      l->shut = true;
      if (l->link->unacknowledged() == 0 || late) {
        close_link(*l);
        continue;
      }
    } else if (late) {
      close_link(*l);
      continue;
    }
    open = true;
  }
  if (!open) return closed_all();  // also when none was open (a world of one)
  timer->expires_after(std::chrono::milliseconds(1));
  timer->async_wait([self = shared_from_this(), timer, cut](const asio::error_code& ec) {
    if (!ec) self->drain(timer, cut);
  });
}

// After close(): the last link is closed.
DCOMM_DECL void transport::closed_all() {
  if (auto timer = close_timer_.lock()) timer->cancel();
  if (auto closed = std::exchange(on_closed_, {})) closed();
}

// The last frame on every live link before an orderly close.
DCOMM_DECL void transport::say_goodbye() {
  const wire_header b = goodbye(first_reason_, first_culprit_);
  for (int p = 0; p < world_; ++p) {
    peer_link& l = *links_[static_cast<std::size_t>(p)];
    if (p == rank_ || l.lost || !l.link->open()) continue;
    l.frames.push_back({b, nullptr, 0, nullptr});
    start_write(p);
  }
}

// Closes the link at once (a goodbye on the side, where its kind sends one
// and it was not lost); the doorbell goes with the last link that needs it.
DCOMM_DECL void transport::close_link(peer_link& l) {
  if (!l.link->open()) return;
  const wire_header bye = goodbye(first_reason_, first_culprit_);
  l.link->close(l.lost ? nullptr : &bye);
  close_bell_if_unused();
  if (closed_ &&
      std::none_of(links_.begin(), links_.end(), [](auto& k) { return k->link->open(); }))
    closed_all();
}

// Start-up failed here after the transport started: goodbyes name the
// rank `failure` blames, also where a peer still in its own start-up
// watches only the mesh's socket (mesh_detail::watch).
DCOMM_DECL void transport::leave_start_up(const std::exception_ptr& failure) {
  auto [reason, culprit] = mesh_detail::cause_of(failure);
  note_cause(reason, culprit);
  const wire_header bye = goodbye(first_reason_, first_culprit_);
  for (int p = 0; p < world_; ++p)
    if (p != rank_) links_[static_cast<std::size_t>(p)]->link->goodbye_to_mesh(bye);
}

// A goodbye the link heard outside its frames: one that came in them
// says more (it is the last frame, after everything the peer sent).
DCOMM_DECL void transport::heard_goodbye(int peer, const wire_header& bye) {
  peer_link& l = *links_[static_cast<std::size_t>(peer)];
  if (l.said_bye) return;
  l.said_bye = true;
  std::tie(l.bye_reason, l.bye_culprit) = read_goodbye(bye, world_);
}

// The connection to `peer` is gone: everything that needs it fails.
DCOMM_DECL void transport::lose_link(int peer, std::string why) {
  peer_link& l = *links_[static_cast<std::size_t>(peer)];
  if (l.lost) return;
  l.lost = true;
  l.why = std::move(why);
  // Gone without a goodbye: killed or crashed. That is a failure of the
  // job even if no call needed the peer yet; the goodbye names it.
  if (!l.said_bye && !stopped()) note_cause(fail_reason::peer_lost, peer);
  close_link(l);
  bool failed_any = false;
  auto fail_pending = [&](io_item* it) {
    if (it->finished()) return;
    failed_any = true;
    fail_item(*it, lost_error(*it->op, peer));
  };
  for (auto* it : l.posted) fail_pending(it);
  l.posted.clear();
  for (auto* it : l.awaiting_data) fail_pending(it);
  l.awaiting_data.clear();
  for (auto* it : l.awaiting_cts) {
    withdraw_offer(l, *it);
    fail_pending(it);
  }
  l.awaiting_cts.clear();
  for (std::size_t i = 0; i < l.frames.size(); ++i)
    if (l.frames[i].item) fail_pending(l.frames[i].item);
  l.frames.truncate(l.batch);
  // Staged sends between parts are in no list of the link.
  for (op_state* op = ops_; op; op = op->next_op)
    for (auto& it : op->items)
      if (it.peer == peer && it.staged && it.state == item_state::queued && !it.in_flight)
        fail_pending(&it);
  // A call in the arena that waits for this peer looks again; so does
  // every agreement (its coordinator, or whom it waits for, may change).
  wake_arena_holder();
  pump_agreements();
  // l.unexpected stays: those messages arrived before the link closed.
  // Calls that still needed this peer have failed above; the others
  // learn it when they post to it, and calls not yet started when they
  // start (add_op). A peer that finished and left is no error by itself.
  if (!stopped() && failed_any)
    log(detail::log_level::warning,
        "rank " + std::to_string(rank_) + " lost rank " + std::to_string(peer) + ": " + l.why);
}

}  // namespace dcomm::cpu
