"""The stores' twin suites on a Redis Cluster: tests of every Redis store, run as written with the store on a cluster
of three masters and three replicas (tests/redis_cluster.py), where a script or a transaction whose keys are in two
slots fails. Each store's twin also checks that every name it wrote carries a hash tag (test_twins.redis_for).

A representative few of each suite, not all of it: the scripts and transactions of each store at least once.
"""

from __future__ import annotations

from tests.redis_cluster import on_cluster
from tests.unit import test_incident_twins as incident_twins
from tests.unit import test_twins as twins
from tests.unit import test_webhook_twins as webhook_twins
from tests.unit.test_incident_twins import incidents, ledger, notices, notifier, stores
from tests.unit.test_twins import buckets, make_conversations, make_log, make_queue, prefix, redis_url, store
from tests.unit.test_webhook_twins import outbox, world

__all__ = [  # fixtures, used by name
    "buckets", "incidents", "ledger", "make_conversations", "make_log", "make_queue", "notices", "notifier",
    "outbox", "prefix", "redis_url", "store", "stores", "world",
]  # fmt: skip

# Rate limits: one script takes both of a tenant's buckets.
test_requests_per_minute = on_cluster(twins.test_requests_per_minute_allow_exactly_the_limit_then_refuse, "buckets")
test_settle = on_cluster(twins.test_settle_charges_an_overrun_and_refunds_the_unused_part, "buckets")
test_tenants_buckets = on_cluster(twins.test_tenants_have_buckets_of_their_own, "buckets")

# The queue: the cap, the lanes, the ring, the stream and the deferred jobs, in its scripts.
test_enqueued = on_cluster(twins.test_an_enqueued_job_is_found_queued_by_its_tenant, "make_queue")
test_first_result = on_cluster(twins.test_the_first_result_stored_for_an_item_wins, "make_queue")
test_turns = on_cluster(twins.test_tenants_take_turns_and_each_keeps_the_order_of_its_own_jobs, "make_queue")
test_waiting_worker = on_cluster(twins.test_a_job_queued_while_a_worker_waits_is_claimed_at_once, "make_queue")
test_deferred = on_cluster(
    twins.test_a_deferred_job_waits_queued_until_due_behind_later_jobs_and_its_deferral_is_no_attempt, "make_queue"
)
test_cap = on_cluster(
    twins.test_a_tenants_cap_counts_every_item_and_refuses_a_job_that_would_pass_it_whole, "make_queue"
)
test_cap_at_once = on_cluster(twins.test_jobs_queued_at_once_never_pass_the_cap_together, "make_queue")
test_finished = on_cluster(twins.test_a_finished_jobs_items_come_back_once_however_often_it_is_finished, "make_queue")

# The isolation events' capped stream.
test_log_capped = on_cluster(twins.test_the_log_is_capped_at_its_capacity, "make_log")
test_log_fields = on_cluster(twins.test_every_field_survives_the_log, "make_log")

# Replicas' states (scripts over two hashes), budgets and blocks.
test_admin_states = on_cluster(twins.test_admin_states_are_set_replaced_and_released, "store")
test_suspension = on_cluster(
    twins.test_a_suspension_never_takes_a_models_last_free_replica_and_is_held_until_a_verdict, "store"
)
test_held = on_cluster(
    twins.test_a_held_replica_is_out_for_an_operator_never_taken_by_a_lapse_nor_the_last_free_one, "store"
)
test_budget = on_cluster(twins.test_a_budget_is_spent_within_its_window_and_renewed_with_the_next, "store")
test_blocks = on_cluster(twins.test_a_budget_forgotten_is_whole_again_and_blocks_hold_until_lifted, "store")

# Stored responses: an owner's keys together in each script.
test_conversation = on_cluster(
    twins.test_a_conversation_is_read_by_its_links_oldest_first_and_within_its_bound, "make_conversations"
)
test_pending_turn = on_cluster(
    twins.test_a_pending_turn_is_replaced_only_while_pending_and_counted_once, "make_conversations"
)
test_owner_bound = on_cluster(
    twins.test_past_its_bound_an_owner_loses_its_oldest_turns_and_no_one_elses, "make_conversations"
)
test_owner_deleted = on_cluster(twins.test_a_deleted_owners_turns_are_all_gone_and_no_one_elses, "make_conversations")

# The exposure ledger, incidents, notices with their webhook messages, the outbox.
test_ledger = on_cluster(incident_twins.test_the_ledger_lists_what_a_replica_served_that_overlaps_the_window, "ledger")
test_clean_probe = on_cluster(incident_twins.test_the_last_clean_probe_before_a_time, "ledger")
test_incident = on_cluster(incident_twins.test_an_incident_opens_then_later_leaks_on_the_replica_join_it, "incidents")
test_sighted_at_once = on_cluster(incident_twins.test_two_instances_sighting_at_once_join_one_incident, "incidents")
test_containment = on_cluster(
    incident_twins.test_containment_ends_the_window_once_and_closing_ends_the_incident, "incidents"
)
test_answers = on_cluster(incident_twins.test_leaks_and_their_answers_are_kept_with_the_incident, "incidents")
test_notices = on_cluster(incident_twins.test_notices_are_kept_once_per_id_newest_first_within_their_bound, "stores")
test_notice_and_message = on_cluster(
    incident_twins.test_a_notice_and_its_webhook_message_are_kept_together_once, "stores"
)
test_notice_sent = on_cluster(incident_twins.test_a_notice_is_sent_to_its_tenants_webhook_once, "stores")
test_claim_order = on_cluster(webhook_twins.test_messages_are_claimed_in_the_order_they_were_sent, "outbox")
test_lease = on_cluster(
    webhook_twins.test_a_claim_holds_a_message_for_its_lease_then_any_instance_reclaims_it, "outbox"
)
test_dead_letter = on_cluster(
    webhook_twins.test_a_message_is_a_dead_letter_after_dead_after_failures_and_still_retried, "outbox"
)
test_max_pending = on_cluster(webhook_twins.test_a_target_holds_at_most_max_pending_its_oldest_dropped, "outbox")
