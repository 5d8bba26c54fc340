"""The real redis-server fixtures (tests/support/redis_servers.py) for this layer.

Under ``BUCKETLIMIT_TEST_MODULE=1`` (CI's second pass over this suite: every server
loads the bucketlimit module, and the limiters run its commands) the tests below
run in the Lua pass only, each for the reason given: they check what only the
scripts do, or a difference the module has by design (docs/redis.md, "The module").
"""

import pytest

from tests.support.redis_servers import *  # noqa: F403
from tests.support.redis_servers import WITH_MODULE

_COUNTS_SCRIPTS = "counts the scripts' own commands (EVALSHA, EVAL) or their loads after NOSCRIPT"

#: Test function -> why the module pass leaves it to the Lua pass.
LUA_ONLY = {
    # What a lost, timed-out or interrupted reply costs, counted in EVALSHA/EVAL calls.
    "test_a_batch_whose_reply_is_lost_is_never_resent": _COUNTS_SCRIPTS,
    "test_allow_many_whose_reply_is_lost_charges_once": _COUNTS_SCRIPTS,
    "test_a_batch_over_several_slots_is_split_one_script_per_slot": _COUNTS_SCRIPTS,
    "test_an_allow_cancelled_while_it_waits_is_left_out_of_the_batch": _COUNTS_SCRIPTS,
    "test_the_senders_interruption_is_its_own": _COUNTS_SCRIPTS,
    "test_a_lost_reply_charges_exactly_once": _COUNTS_SCRIPTS,
    "test_other_errors_are_not_retried": _COUNTS_SCRIPTS,
    "test_a_timed_out_command_is_not_sent_again": _COUNTS_SCRIPTS,
    "test_a_grant_whose_reply_is_lost_expires_by_its_ttl": _COUNTS_SCRIPTS,
    "test_a_release_whose_reply_is_lost_frees_once": _COUNTS_SCRIPTS,
    "test_a_combined_acquire_is_one_evalsha": _COUNTS_SCRIPTS,
    "test_leases_take_twenty_times_fewer_commands_for_the_same_calls": _COUNTS_SCRIPTS,
    "test_a_probe_after_the_retry_interval_closes_the_breaker": _COUNTS_SCRIPTS,
    "test_a_queued_waiter_whose_reply_is_lost_is_handed_a_slot_that_expires": _COUNTS_SCRIPTS,
    # The audit of every key the scripts' own commands touch (MONITOR).
    "test_every_key_a_script_touches_is_declared_in_its_keys": (
        "audits the commands a script runs inside; a module command declares its keys itself"
    ),
    # The NOSCRIPT reload (script_loads).
    "test_a_restart_without_persistence_costs_one_fresh_burst": _COUNTS_SCRIPTS,
    "test_a_restart_loses_the_permits_and_their_holders_are_told": _COUNTS_SCRIPTS,
    "test_a_stopped_server_then_a_restarted_one": _COUNTS_SCRIPTS,
    "test_script_flush_mid_run_costs_no_error_and_no_token": _COUNTS_SCRIPTS,
    "test_a_script_lost_by_the_server_is_sent_whole_by_both": _COUNTS_SCRIPTS,
    "test_properties_repr_and_stats": _COUNTS_SCRIPTS,
    "test_async_limiter_matches_in_process": _COUNTS_SCRIPTS,
    "test_async_cluster": _COUNTS_SCRIPTS,
    # The scripts' own configuration errors.
    "test_credentials_and_acls_are_configuration_errors": "the ACL names the scripts' commands",
    "test_a_server_without_scripting_is_a_configuration_error": "scripting switched off",
    "test_a_store_without_lua_is_a_configuration_error_under_every_policy": (
        "the module serves a store without Lua: no script runs"
    ),
    # TIME refused in scripts: the module reads the server's clock itself, never by TIME.
    "test_a_store_refusing_time_is_served_with_the_time_sent": "the module never calls TIME",
    "test_permits_and_reservations_work_without_time": "the module never calls TIME",
    # Differences by design.
    "test_a_corrupt_value_is_never_an_allow": (
        "a balance past 2**53 is a bucket to the module (the core's range), corrupt to Lua"
    ),
    "test_a_key_first_gets_the_stores_answer_then_a_lease_sized_from_its_demand": (
        "the module's batch answers a leased bucket's allow itself: one round trip fewer"
    ),
    "test_a_batch_sends_an_allow_of_a_leased_bucket_alone": (
        "the module's batch answers a leased bucket's allow itself: nothing is sent alone"
    ),
    "test_a_demoted_primary_is_one_outage_not_a_flapping_breaker": (
        "a replica refuses every module command (they write), refusals too: READONLY"
    ),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not WITH_MODULE:
        return
    for item in items:
        why = LUA_ONLY.get(getattr(item, "originalname", item.name))
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=f"the Lua pass runs it: {why}"))
