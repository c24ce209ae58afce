"""Multi-GPU evaluation of a LoFTR checkpoint on MegaDepth-1500 (relative pose AUC@5/10/20).

The checkpoint comes from our DDP training (keys start with "module.").  Pairs are split round-robin over
the ranks, every rank writes its raw matches to its own h5 file and estimates the poses of its pairs;
rank 0 collects the per-pair errors and computes the AUC.

    torchrun --standalone --nproc_per_node=8 18_eval_megadepth1500_multi_gpu.py \
        --ckpt runs/loftr_ds/best.ckpt --data /data/megadepth_test_1500 --out results/loftr_ds_md1500
"""
import argparse
import json
import os
import time

import cv2
import h5py
import numpy as np
import torch
import torch.distributed as dist
from kornia.feature import LoFTR
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

SCENES = ["0015_0.1_0.3", "0015_0.3_0.5", "0022_0.1_0.3", "0022_0.3_0.5", "0022_0.5_0.7"]


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resize", type=int, default=840)
    ap.add_argument("--ransac_thr", type=float, default=0.5)
    ap.add_argument("--conf_thr", type=float, default=0.2)
    return ap.parse_args()


def load_pairs(root):
    pairs = []
    for scene in SCENES:
        info = np.load(os.path.join(root, "scene_info", f"{scene}.npz"), allow_pickle=True)
        for (i, j), _, _ in info["pair_infos"]:
            pairs.append({
                "scene": scene, "im0": str(info["image_paths"][i]), "im1": str(info["image_paths"][j]),
                "K0": info["intrinsics"][i], "K1": info["intrinsics"][j],
                "T_0to1": info["poses"][j] @ np.linalg.inv(info["poses"][i]),
            })
    return pairs


def read_gray(path, resize, device):
    img = cv2.imread(path, cv2.IMREAD_GRAYSCALE)
    h, w = img.shape
    s = resize / max(h, w)
    nh, nw = int(round(h * s / 8)) * 8, int(round(w * s / 8)) * 8
    img = cv2.resize(img, (nw, nh), interpolation=cv2.INTER_AREA)
    t = torch.from_numpy(img).float().div(255.0)[None, None].to(device)
    return t, np.array([w / nw, h / nh])


def relative_pose_error(T_0to1, R, t):
    t_gt = T_0to1[:3, 3]
    n = np.linalg.norm(t) * np.linalg.norm(t_gt)
    e_t = np.rad2deg(np.arccos(np.clip(np.dot(t, t_gt) / n, -1.0, 1.0)))
    e_t = np.minimum(e_t, 180 - e_t)
    cos = (np.trace(np.dot(T_0to1[:3, :3].T, R)) - 1) / 2
    return e_t, np.rad2deg(np.abs(np.arccos(np.clip(cos, -1.0, 1.0))))


def estimate_pose(kpts0, kpts1, K0, K1, thresh, conf=0.99999):
    if len(kpts0) < 5:
        return None
    f_mean = np.mean([K0[0, 0], K1[1, 1], K0[0, 0], K1[1, 1]])
    norm_thresh = thresh / f_mean
    kpts0 = (kpts0 - K0[[0, 1], [2, 2]][None]) / K0[[0, 1], [0, 1]][None]
    kpts1 = (kpts1 - K1[[0, 1], [2, 2]][None]) / K1[[0, 1], [0, 1]][None]
    E, mask = cv2.findEssentialMat(kpts0, kpts1, np.eye(3), threshold=norm_thresh, prob=conf, method=cv2.RANSAC)
    if E is None:
        return None
    best = None
    best_n = 0
    for _E in np.split(E, len(E) / 3):
        n, R, t, _ = cv2.recoverPose(_E, kpts0, kpts1, np.eye(3), 1e9, mask=mask)
        if n > best_n:
            best_n, best = n, (R, t[:, 0])
    return best


def pose_auc(errors, thresholds=(5, 10, 20)):
    sort_idx = np.argsort(errors)
    errors = np.array(errors.copy())[sort_idx]
    recall = (np.arange(len(errors)) + 1) / len(errors)
    errors = np.r_[0.0, errors]
    recall = np.r_[0.0, recall]
    aucs = []
    for t in thresholds:
        last_index = np.searchsorted(errors, t)
        r = np.r_[recall[:last_index], recall[last_index - 1]]
        e = np.r_[errors[:last_index], t]
        aucs.append(np.trapz(r, x=e) / t)
    return aucs


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    matcher = LoFTR(pretrained=None)
    ckpt = torch.load(args.ckpt, map_location="cpu")
    sd = ckpt.get("state_dict", ckpt)
    consume_prefix_in_state_dict_if_present(sd, "module.")
    consume_prefix_in_state_dict_if_present(sd, "matcher.")
    matcher.load_state_dict(sd)
    matcher = matcher.eval().to(device)

    pairs = load_pairs(args.data)
    mine = list(range(rank, len(pairs), world))  # no padding: each pair is evaluated exactly once
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(pairs)} pairs over {world} ranks")
    dist.barrier()

    part_file = os.path.join(args.out, f"matches.rank{rank}.h5")
    local = []  # (pair index, pose error, number of matches)
    t0 = time.time()
    with h5py.File(part_file, "w") as fout, torch.inference_mode():
        for n, idx in enumerate(mine):
            p = pairs[idx]
            im0, s0 = read_gray(os.path.join(args.data, p["im0"]), args.resize, device)
            im1, s1 = read_gray(os.path.join(args.data, p["im1"]), args.resize, device)
            out = matcher({"image0": im0, "image1": im1})
            keep = out["confidence"] > args.conf_thr
            k0 = out["keypoints0"][keep].cpu().numpy() * s0
            k1 = out["keypoints1"][keep].cpu().numpy() * s1
            g = fout.create_group(str(idx))
            g.create_dataset("kpts0", data=k0.astype(np.float32))
            g.create_dataset("kpts1", data=k1.astype(np.float32))
            ret = estimate_pose(k0, k1, p["K0"], p["K1"], args.ransac_thr)
            if ret is None:
                err = np.inf
            else:
                e_t, e_R = relative_pose_error(p["T_0to1"], *ret)
                err = float(max(e_t, e_R))
            g.attrs["pose_error"] = err
            local.append((idx, err, len(k0)))
            if rank == 0 and n % 50 == 0:
                print(f"[rank0] {n}/{len(mine)} ({time.time() - t0:.0f}s)", flush=True)

    # ranks finish at different times; the gather below waits for the slowest one
    gathered = [None] * world
    dist.all_gather_object(gathered, local)

    if rank == 0:
        rows = sorted(r for part in gathered for r in part)
        assert len(rows) == len(pairs) and len({r[0] for r in rows}) == len(pairs)
        errors = np.array([r[1] for r in rows])
        per_scene = {}
        for idx, err, _ in rows:
            per_scene.setdefault(pairs[idx]["scene"], []).append(err)
        aucs = pose_auc(errors)
        result = {"auc@5": aucs[0], "auc@10": aucs[1], "auc@20": aucs[2], "num_pairs": len(rows),
                  "mean_matches": float(np.mean([r[2] for r in rows])),
                  "per_scene_auc@10": {s: pose_auc(np.array(e))[1] for s, e in per_scene.items()},
                  "ckpt": args.ckpt, "match_files": [f"matches.rank{r}.h5" for r in range(world)]}
        print(json.dumps(result, indent=2))
        with open(os.path.join(args.out, "md1500_results.json"), "w") as f:
            json.dump(result, f, indent=2)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
