// Elastic jobs (docs/elastic.md): grow() admits the processes waiting in
// join(), ranked after the members (elastic/grow.hpp); heal() brings every
// member the state of the most advanced one and checks that all hold the
// same bits (elastic/heal.hpp). Revoke, agree and shrink are the
// communicator's own (communicator.hpp). Not in dcomm.hpp: include it.
#pragma once

#include "dcomm/elastic/grow.hpp"
#include "dcomm/elastic/heal.hpp"
