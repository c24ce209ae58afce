"""ViTPose-G (ViT-g/14, ~1B params) top-down pose with FSDP, bf16, 2 nodes x 8 GPUs.

    srun --nodes=2 --ntasks-per-node=1 torchrun --nnodes=2 --nproc_per_node=8 \
        --rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500 19_vitpose_g_fsdp.py --out /shared/exp/vitpose_g
"""
import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from vitpose.backbone import ViT, Block
from vitpose.datasets import TopDownCocoDataset
from vitpose.post import keypoints_from_heatmaps
from vitpose.coco import evaluate_coco_keypoints


class ViTPoseG(nn.Module):
    def __init__(self, pretrained=None):
        super().__init__()
        self.backbone = ViT(img_size=(256, 192), patch_size=14, embed_dim=1408, depth=40, num_heads=16,
                            mlp_ratio=48 / 11, drop_path_rate=0.5, padding=2)
        if pretrained:
            sd = torch.load(pretrained, map_location="cpu")
            self.backbone.load_state_dict(sd.get("model", sd), strict=False)
        # simple decoder: no BatchNorm, so nothing to sync across the shards
        self.head = nn.Sequential(nn.ReLU(), nn.Upsample(scale_factor=4, mode="bilinear", align_corners=False),
                                  nn.Conv2d(1408, 17, 3, padding=1))

    def forward(self, x):
        return self.head(self.backbone(x))


def save_full_state(model, path, rank):
    if rank == 0:
        cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, path)


@torch.no_grad()
def evaluate(model, loader, ann_file, out_file):
    model.eval()
    part = []
    for b in loader:
        img = b["img"].cuda(non_blocking=True)
        hm = model(img)
        hm_f = model(img.flip(3)).flip(3)[:, b["flip_index"][0]]
        hm = ((hm + hm_f) / 2).float().cpu().numpy()
        kpts = keypoints_from_heatmaps(hm, b["center"].numpy(), b["scale"].numpy(), use_udp=True)
        for i in range(len(kpts)):
            part.append({"idx": int(b["idx"][i]), "image_id": int(b["image_id"][i]),
                         "keypoints": kpts[i].tolist(), "box_score": float(b["box_score"][i])})
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, part)
    if dist.get_rank() != 0:
        return None
    merged = {r["idx"]: r for p in everything for r in p}
    return evaluate_coco_keypoints(ann_file, list(merged.values()), out_file)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-root", default="/shared/datasets/coco")
    ap.add_argument("--pretrained", default="/shared/weights/vit_g_mae.pth")
    ap.add_argument("--out", default="/shared/exp/vitpose_g")
    ap.add_argument("--epochs", type=int, default=210)
    ap.add_argument("--batch-per-gpu", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    train_set = TopDownCocoDataset(args.data_root, "train2017", (256, 192), train=True, use_udp=True)
    val_set = TopDownCocoDataset(args.data_root, "val2017", (256, 192), train=False, use_udp=True,
                                 det_bbox_file="person_detection_results/COCO_val2017_detections_AP_H_56_person.json")
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, args.batch_per_gpu, sampler=sampler, num_workers=8, pin_memory=True,
                        drop_last=True, persistent_workers=True)
    val_loader = DataLoader(val_set, 32, sampler=DistributedSampler(val_set, shuffle=False), num_workers=8)

    model = ViTPoseG(args.pretrained)
    # decided before wrapping: with use_orig_params the parameters are flat shards afterwards
    no_decay_names = {n for n, p in model.named_parameters() if p.ndim <= 1 or "pos_embed" in n}
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    model = FSDP(model, auto_wrap_policy=wrap, mixed_precision=bf16, sharding_strategy=ShardingStrategy.FULL_SHARD,
                 device_id=torch.cuda.current_device(), use_orig_params=True, limit_all_gathers=True)
    clean = lambda n: n.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
    no_decay = [p for n, p in model.named_parameters() if clean(n) in no_decay_names]
    decay = [p for n, p in model.named_parameters() if clean(n) not in no_decay_names]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.999))
    iters = len(loader)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 500) * (0.1 ** sum(s >= m * iters for m in (170, 200))))

    best_ap = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for i, b in enumerate(loader):
            img = b["img"].cuda(non_blocking=True)
            target = b["target"].cuda(non_blocking=True)
            tw = b["target_weight"].cuda(non_blocking=True)
            out = model(img)
            loss = 0.5 * F.mse_loss(out.float() * tw[..., None], target * tw[..., None])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            sched.step()
            if rank == 0 and i % 20 == 0:
                print(f"epoch {epoch} [{i}/{iters}] loss {loss.item():.6f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / (i + 1):.2f}s/it", flush=True)

        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            stats = evaluate(model, val_loader, val_set.ann_file, os.path.join(args.out, f"val_{epoch + 1}.json"))
            if rank == 0:
                print(f"epoch {epoch + 1}: {json.dumps(stats)}", flush=True)
            ap_t = torch.tensor([stats["AP"] if rank == 0 else 0.0], device="cuda")
            dist.broadcast(ap_t, src=0)
            if ap_t.item() > best_ap:
                best_ap = ap_t.item()
                save_full_state(model, os.path.join(args.out, "best_full.pth"), rank)
        dist.barrier()

    save_full_state(model, os.path.join(args.out, "final_full.pth"), rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
