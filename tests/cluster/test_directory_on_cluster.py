"""The tenant directory's store twin on a Redis Cluster: its suite's store tests, run as written with the Redis twin
on the cluster (tests/redis_cluster.py). Every change is a script over keys that share the tag `{tenants}`, and is
heard on a pub/sub channel, which a cluster delivers to a subscriber on any node."""

from __future__ import annotations

from tests.redis_cluster import on_cluster
from tests.unit import test_directory as directory
from tests.unit.test_directory import clock, namespace, redis_url, store

__all__ = ["clock", "namespace", "redis_url", "store"]  # fixtures, used by name

test_added = on_cluster(directory.test_a_tenant_is_added_once_read_back_and_listed_in_pages, "store")
test_updated = on_cluster(directory.test_an_update_is_applied_to_the_tenant_as_it_is_now, "store")
test_concurrent = on_cluster(directory.test_concurrent_updates_are_all_kept, "store")
test_keys = on_cluster(directory.test_keys_belong_to_an_existing_tenant_and_are_looked_up_with_it, "store")
test_removed = on_cluster(directory.test_a_revoked_key_is_gone_and_a_deleted_tenant_takes_its_keys, "store")
test_rotation = on_cluster(
    directory.test_rotation_adds_the_new_key_and_shortens_the_old_one_never_lengthens_it, "store"
)
test_last_used = on_cluster(directory.test_last_used_times_only_move_forward_and_only_for_keys_that_exist, "store")
test_check_secret = on_cluster(directory.test_the_check_secret_is_made_once_and_shared, "store")
test_followers = on_cluster(directory.test_every_change_is_heard_by_every_follower, "store")
test_another_instance = on_cluster(directory.test_a_change_on_one_instance_reaches_another_at_once, "store")
test_resync = on_cluster(directory.test_a_resync_catches_a_change_whose_message_was_lost, "store")
