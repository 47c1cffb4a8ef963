"""The TensorFlow values tests/test_tf_habits.py compares with (run once per replica count).

    pip install --target /tmp/tfenv "tensorflow-cpu==2.21.*"
    for n in 2 4 8; do PYTHONPATH=/tmp/tfenv python tests/_scripts/tf_habits_values.py $n; done

Each replica count runs in its own process: tf refuses collectives of two group sizes in one.
Measured with tensorflow-cpu 2.21 on 2026-11-25; the values are written into the tests.
"""

import json
import os
import sys

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.distribute.cluster_resolver import TFConfigClusterResolver  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 8)
out = {}
for n in [int(sys.argv[1])]:
    s = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(n)])
    v = tf.constant([1., 2., 3.])
    out[f"reduce_sum_plain_axis0_{n}"] = float(s.reduce("SUM", v, axis=0))
    try:
        out[f"reduce_sum_plain_axisNone_{n}"] = s.reduce("SUM", v, axis=None).numpy().tolist()
    except Exception as e:
        out[f"reduce_sum_plain_axisNone_{n}"] = f"{type(e).__name__}: {str(e)[:120]}"
    out[f"reduce_mean_plain_axis0_{n}"] = float(s.reduce("MEAN", v, axis=0))
    # 13 rows, global batch 8: mean over the last batch's per-example values.
    rows = tf.data.Dataset.from_tensor_slices(np.arange(13, dtype=np.float32))
    ds = s.experimental_distribute_dataset(rows.batch(8))
    means, gathers, sums = [], [], []
    for b in ds:
        pe = s.run(lambda x: x * 1.0, args=(b,))
        means.append(float(s.reduce("MEAN", pe, axis=0)))
        sums.append(float(s.reduce("SUM", pe, axis=0)))
        gathers.append(s.gather(pe, axis=0).numpy().tolist())
    out[f"partial_mean_{n}"] = means
    out[f"partial_sum_{n}"] = sums
    out[f"partial_gather_{n}"] = gathers
out["ReduceOp_SUM"] = str(tf.distribute.ReduceOp("SUM"))
out["compute_average_loss_weights"] = float(tf.nn.compute_average_loss(
    tf.constant([1., 2., 3., 4.]), sample_weight=tf.constant([1., 0., 1., .5])))
out["compute_average_loss_no_weights"] = float(tf.nn.compute_average_loss(tf.constant([1., 2., 3., 4.])))


def resolve(cfg):
    os.environ["TF_CONFIG"] = json.dumps(cfg)
    try:
        r = TFConfigClusterResolver()
        spec = r.cluster_spec().as_dict()
        # multi_worker_util validation, as MultiWorkerMirroredStrategy does
        from tensorflow.python.distribute import multi_worker_util
        multi_worker_util._validate_cluster_spec(r.cluster_spec(), r.task_type, r.task_id)
        return {"ok": spec}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
out["tf_config_two_evaluators"] = resolve({"cluster": {"worker": ["h0:2222"],
                                                       "evaluator": ["h1:2222", "h2:2222"]},
                                           "task": {"type": "worker", "index": 0}})
out["tf_config_sparse"] = resolve({"cluster": {"worker": {"0": "h0:2222", "1": "h1:2222"}},
                                   "task": {"type": "worker", "index": 1}})
print(json.dumps(out, indent=1))
