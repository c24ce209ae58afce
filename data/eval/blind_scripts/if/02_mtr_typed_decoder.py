"""MTR-style motion transformer on the Waymo Open Motion Dataset (preprocessed pkl).

Each focal agent is decoded by the head of its own agent type (vehicle /
pedestrian / cyclist) with a set of intention queries.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 \
        02_mtr_typed_decoder.py --cfg cfgs/mtr_typed.yaml
"""
import argparse
import datetime
import os
import pickle
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

AGENT_TYPES = ("TYPE_VEHICLE", "TYPE_PEDESTRIAN", "TYPE_CYCLIST")


def get_cfg():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", required=True)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--extra-tag", default="default")
    args = parser.parse_args()
    with open(args.cfg) as f:
        cfg = yaml.safe_load(f)
    cfg["resume"] = args.resume
    cfg["out_dir"] = os.path.join(cfg.get("out_root", "/mnt/shared/mtr_runs"), args.extra_tag)
    return cfg


def build_info_index(data_root, split):
    """Scan processed scenarios once and store light-weight metadata next to them."""
    index_path = Path(data_root) / f"{split}_infos.pkl"
    if index_path.exists():
        return index_path
    infos = []
    for f in sorted((Path(data_root) / split).glob("sample_*.pkl")):
        with open(f, "rb") as fh:
            sc = pickle.load(fh)
        infos.append({
            "file": f.name,
            "scenario_id": sc["scenario_id"],
            "tracks_to_predict": sc["tracks_to_predict"]["track_index"],
            "object_type": [sc["track_infos"]["object_type"][i]
                            for i in sc["tracks_to_predict"]["track_index"]],
        })
    tmp = index_path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        pickle.dump(infos, fh)
    os.replace(tmp, index_path)
    return index_path


class WaymoMotionDataset(Dataset):
    def __init__(self, data_root, split, index_path, max_polylines=768, max_agents=64):
        self.dir = Path(data_root) / split
        with open(index_path, "rb") as fh:
            self.infos = pickle.load(fh)
        self.max_polylines = max_polylines
        self.max_agents = max_agents

    def __len__(self):
        return len(self.infos)

    def __getitem__(self, idx):
        info = self.infos[idx]
        with open(self.dir / info["file"], "rb") as fh:
            sc = pickle.load(fh)
        trajs = sc["track_infos"]["trajs"].astype(np.float32)  # [N, 91, 10]
        cur = sc["current_time_index"]
        center = sc["tracks_to_predict"]["track_index"][0]
        origin = trajs[center, cur, :2].copy()
        yaw = trajs[center, cur, 6]
        c, s = np.cos(-yaw), np.sin(-yaw)
        rot = np.array([[c, -s], [s, c]], dtype=np.float32)
        xy = (trajs[..., :2] - origin) @ rot.T
        hist = np.concatenate([xy[:, : cur + 1], trajs[:, : cur + 1, 7:9] @ rot.T,
                               trajs[:, : cur + 1, 9:10]], axis=-1)
        fut = xy[:, cur + 1:]
        fut_valid = trajs[:, cur + 1:, 9] > 0
        polys = sc["map_infos"]["all_polylines"].astype(np.float32)[: self.max_polylines * 20]
        polys = polys.reshape(-1, 20, polys.shape[-1])[..., :4]
        polys[..., :2] = (polys[..., :2] - origin) @ rot.T

        A = min(len(trajs), self.max_agents)
        focal = [i for i in sc["tracks_to_predict"]["track_index"] if i < A]
        type_ids = [AGENT_TYPES.index(sc["track_infos"]["object_type"][i]) for i in focal]
        return {
            "hist": torch.from_numpy(hist[:A]),
            "fut": torch.from_numpy(fut[:A]),
            "fut_valid": torch.from_numpy(fut_valid[:A]),
            "map": torch.from_numpy(polys),
            "focal": torch.tensor(focal, dtype=torch.long),
            "focal_type": torch.tensor(type_ids, dtype=torch.long),
            "scenario_id": sc["scenario_id"],
        }


def collate(samples):
    B = len(samples)
    A = max(s["hist"].shape[0] for s in samples)
    P = max(s["map"].shape[0] for s in samples)
    T_h, T_f = samples[0]["hist"].shape[1], samples[0]["fut"].shape[1]
    out = {
        "hist": torch.zeros(B, A, T_h, 5), "agent_mask": torch.zeros(B, A, dtype=torch.bool),
        "fut": torch.zeros(B, A, T_f, 2), "fut_valid": torch.zeros(B, A, T_f, dtype=torch.bool),
        "map": torch.zeros(B, P, 20, 4), "map_mask": torch.zeros(B, P, dtype=torch.bool),
    }
    focal_b, focal_a, focal_t, ids = [], [], [], []
    for b, s in enumerate(samples):
        a, p = s["hist"].shape[0], s["map"].shape[0]
        out["hist"][b, :a] = s["hist"]
        out["agent_mask"][b, :a] = s["hist"][:, -1, 4] > 0
        out["fut"][b, :a] = s["fut"]
        out["fut_valid"][b, :a] = s["fut_valid"]
        out["map"][b, :p] = s["map"]
        out["map_mask"][b, :p] = True
        focal_b.append(torch.full_like(s["focal"], b))
        focal_a.append(s["focal"])
        focal_t.append(s["focal_type"])
        ids.extend([s["scenario_id"]] * len(s["focal"]))
    out["focal_b"] = torch.cat(focal_b)
    out["focal_a"] = torch.cat(focal_a)
    out["focal_type"] = torch.cat(focal_t)
    out["scenario_ids"] = ids
    return out


class TypedIntentionDecoder(nn.Module):
    def __init__(self, d, num_modes, fut_steps):
        super().__init__()
        self.num_modes, self.fut_steps = num_modes, fut_steps
        self.queries = nn.Parameter(torch.randn(num_modes, d) * 0.02)
        self.attn = nn.MultiheadAttention(d, 8, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.reg = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, fut_steps * 2))
        self.cls = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 1))

    def forward(self, agent_feat, scene, scene_pad):  # agent_feat [N, d], scene [N, S, d]
        q = self.queries[None] + agent_feat[:, None]
        x, _ = self.attn(q, scene, scene, key_padding_mask=scene_pad)
        x = self.norm(x + q)
        traj = self.reg(x).view(-1, self.num_modes, self.fut_steps, 2)
        return traj, self.cls(x).squeeze(-1)


class MotionTransformer(nn.Module):
    def __init__(self, d=256, depth=6, num_modes=6, hist_steps=11, fut_steps=80):
        super().__init__()
        self.agent_enc = nn.Sequential(nn.Linear(hist_steps * 5, d), nn.ReLU(), nn.Linear(d, d))
        self.map_enc = nn.Sequential(nn.Linear(4, d), nn.ReLU(), nn.Linear(d, d))
        layer = nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.decoders = nn.ModuleList(TypedIntentionDecoder(d, num_modes, fut_steps)
                                      for _ in AGENT_TYPES)

    def forward(self, batch):
        a = self.agent_enc(batch["hist"].flatten(2))
        m = self.map_enc(batch["map"]).max(dim=2).values
        pad = ~torch.cat([batch["agent_mask"], batch["map_mask"]], dim=1)
        scene = self.encoder(torch.cat([a, m], 1), src_key_padding_mask=pad)
        fb, fa, ft = batch["focal_b"], batch["focal_a"], batch["focal_type"]
        agent_feat, ctx, ctx_pad = scene[fb, fa], scene[fb], pad[fb]
        N = fb.numel()
        trajs = scene.new_zeros(N, self.decoders[0].num_modes, self.decoders[0].fut_steps, 2)
        logits = scene.new_zeros(N, self.decoders[0].num_modes)
        for t, dec in enumerate(self.decoders):
            sel = ft == t
            if sel.any():
                trajs[sel], logits[sel] = dec(agent_feat[sel], ctx[sel], ctx_pad[sel])
        return trajs, logits


def motion_loss(trajs, logits, gt, gt_valid):
    vm = gt_valid[:, None].float()
    ade = ((trajs - gt[:, None]).norm(dim=-1) * vm).sum(-1) / vm.sum(-1).clamp(min=1)
    best = ade.argmin(-1)
    reg = F.smooth_l1_loss(trajs[torch.arange(len(best)), best], gt, reduction="none").sum(-1)
    reg = (reg * gt_valid).sum() / gt_valid.sum().clamp(min=1)
    return reg + F.cross_entropy(logits, best), ade


@torch.no_grad()
def evaluate(model, loader, device, rank, world_size):
    model.eval()
    sums = torch.zeros(4, device=device)  # minADE, minFDE, misses, count
    preds = []
    for batch in loader:
        ids = batch.pop("scenario_ids")
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        trajs, logits = model(batch)
        gt = batch["fut"][batch["focal_b"], batch["focal_a"]]
        gv = batch["fut_valid"][batch["focal_b"], batch["focal_a"]]
        _, ade = motion_loss(trajs, logits, gt, gv)
        keep = gv[:, -1]
        fde = (trajs[:, :, -1] - gt[:, None, -1]).norm(dim=-1).min(-1).values
        sums += torch.stack([ade.min(-1).values[keep].sum(), fde[keep].sum(),
                             (fde[keep] > 2.0).sum().float(), keep.sum().float()])
        top = logits.softmax(-1).cpu().numpy()
        for i, sid in enumerate(ids):
            preds.append((sid, trajs[i].cpu().numpy().astype(np.float16), top[i]))
    dist.all_reduce(sums)
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(preds, gathered, dst=0)
    model.train()
    n = sums[3].clamp(min=1)
    metrics = {"minADE": (sums[0] / n).item(), "minFDE": (sums[1] / n).item(),
               "MR": (sums[2] / n).item()}
    all_preds = [p for part in gathered for p in part] if rank == 0 else None
    return metrics, all_preds


def main():
    cfg = get_cfg()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the first run scans ~487k scenarios on rank 0 while the others wait at the barrier
    dist.init_process_group("nccl", timeout=datetime.timedelta(hours=3))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.get("seed", 0))

    if rank == 0:
        build_info_index(cfg["data_root"], "processed_scenarios_training")
        build_info_index(cfg["data_root"], "processed_scenarios_validation")
    dist.barrier()
    train_idx = Path(cfg["data_root"]) / "processed_scenarios_training_infos.pkl"
    val_idx = Path(cfg["data_root"]) / "processed_scenarios_validation_infos.pkl"
    train_ds = WaymoMotionDataset(cfg["data_root"], "processed_scenarios_training", train_idx)
    val_ds = WaymoMotionDataset(cfg["data_root"], "processed_scenarios_validation", val_idx)

    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=cfg["batch_size_per_gpu"], sampler=sampler,
                              num_workers=cfg.get("workers", 8), collate_fn=collate,
                              pin_memory=True, drop_last=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world_size)),
                            batch_size=cfg["batch_size_per_gpu"], num_workers=cfg.get("workers", 8),
                            collate_fn=collate)

    model = MotionTransformer(cfg["d_model"], cfg["depth"], cfg["num_modes"]).to(device)
    # a batch does not always contain all three agent types, so a typed decoder can sit out a step
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    base_lr = cfg["lr"] * cfg["batch_size_per_gpu"] * world_size / cfg.get("ref_batch", 80)
    optimizer = torch.optim.AdamW(model.parameters(), lr=base_lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, cfg.get("decay_epochs", [22, 24, 26, 28]), 0.5)

    start_epoch = 0
    if cfg["resume"]:
        ckpt = torch.load(cfg["resume"], map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"] + 1

    if rank == 0:
        os.makedirs(cfg["out_dir"], exist_ok=True)
    for epoch in range(start_epoch, cfg["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            batch.pop("scenario_ids")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            trajs, logits = model(batch)
            gt = batch["fut"][batch["focal_b"], batch["focal_a"]]
            gv = batch["fut_valid"][batch["focal_b"], batch["focal_a"]]
            loss, _ = motion_loss(trajs, logits, gt, gv)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1000.0)
            optimizer.step()
            if rank == 0 and it % 50 == 0:
                print(f"ep {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)
        scheduler.step()

        metrics, preds = evaluate(model, val_loader, device, rank, world_size)
        if rank == 0:
            print(f"epoch {epoch} {metrics} ({time.time() - t0:.0f}s)", flush=True)
            with open(os.path.join(cfg["out_dir"], f"val_preds_ep{epoch}.pkl"), "wb") as fh:
                pickle.dump(preds, fh)
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch},
                       os.path.join(cfg["out_dir"], f"checkpoint_epoch_{epoch}.pth"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
