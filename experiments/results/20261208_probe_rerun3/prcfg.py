import importlib.util
spec = importlib.util.spec_from_file_location("qs", "/work/wt/k22probe/configs/quickstart.py")
qs = importlib.util.module_from_spec(spec); spec.loader.exec_module(qs)

def get_config():
    c = qs.get_config()
    c.resource_pool = dict(rollout_pool=dict(n_devices=1), global_pool=dict(n_devices=1))
    c.placement.rollout = "rollout_pool"
    c.trainer.rollout_mode = "async"
    c.trainer.staleness_threshold = 1
    c.trainer.partial_rollout = True
    c.trainer.max_actor_ckpt_to_keep = 10
    c.actor_rollout_ref.rollout.max_num_seqs = 4
    return c
