"""Audio Spectrogram Transformer on AudioSet with FSDP (full shard, bf16).

Launch (2 nodes x 8 GPUs):
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        02_audioset_ast_fsdp.py --train-json data/unbal_train.json --eval-json data/eval.json \
        --label-csv data/class_labels_indices.csv --out /shared/exp/ast_fsdp
"""
import argparse
import csv
import functools
import json
import math
import os
import shutil
import time

import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy import stats
from sklearn.metrics import average_precision_score, roc_auc_score
from timm.models.vision_transformer import Block
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchaudio.transforms import FrequencyMasking, MelSpectrogram, TimeMasking

SR, N_FRAMES, N_MELS = 16000, 1024, 128
NORM_MEAN, NORM_STD = -4.2677393, 4.5689974


def load_label_map(path):
    with open(path) as f:
        return {row["mid"]: int(row["index"]) for row in csv.DictReader(f)}


class AudioSetJson(Dataset):
    def __init__(self, json_path, label_map):
        with open(json_path) as f:
            self.items = json.load(f)["data"]
        self.label_map = label_map
        self.n_cls = len(label_map)
        self.n_samples = int(SR * N_FRAMES / 100)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        item = self.items[i]
        wav, sr = sf.read(item["wav"], dtype="float32")
        if wav.ndim == 2:
            wav = wav.mean(1)
        assert sr == SR, item["wav"]
        wav = wav - wav.mean()
        out = np.zeros(self.n_samples, dtype=np.float32)
        out[: min(len(wav), self.n_samples)] = wav[: self.n_samples]
        target = np.zeros(self.n_cls, dtype=np.float32)
        for mid in item["labels"].split(","):
            target[self.label_map[mid]] = 1.0
        return torch.from_numpy(out), torch.from_numpy(target), i


class Fbank(nn.Module):
    def __init__(self):
        super().__init__()
        self.mel = MelSpectrogram(SR, n_fft=400, win_length=400, hop_length=160, n_mels=N_MELS,
                                  f_min=20, f_max=8000, window_fn=torch.hann_window)
        self.fm, self.tm = FrequencyMasking(48), TimeMasking(192)

    @torch.no_grad()
    def forward(self, wav, augment=False):
        x = torch.log(self.mel(wav) + 1e-6)[..., :N_FRAMES]        # B, F, T
        if augment:
            x = self.tm(self.fm(x))
        x = (x - NORM_MEAN) / (NORM_STD * 2)
        return x.transpose(1, 2)                                      # B, T, F


class AST(nn.Module):
    def __init__(self, num_classes=527, dim=768, depth=12, heads=12, stride=10, drop_path=0.1):
        super().__init__()
        self.patch_embed = nn.Conv2d(1, dim, kernel_size=16, stride=stride)
        f_dim = (N_MELS - 16) // stride + 1
        t_dim = (N_FRAMES - 16) // stride + 1
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, f_dim * t_dim + 2, dim))
        dpr = [x.item() for x in torch.linspace(0, drop_path, depth)]
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio=4.0, qkv_bias=True, drop_path=dpr[i])
                                     for i in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_classes))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.dist_token, std=0.02)

    def forward(self, x):
        x = self.patch_embed(x.unsqueeze(1).transpose(2, 3)).flatten(2).transpose(1, 2)
        b = x.size(0)
        x = torch.cat([self.cls_token.expand(b, -1, -1), self.dist_token.expand(b, -1, -1), x], dim=1)
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return self.head((x[:, 0] + x[:, 1]) / 2)


def d_prime(auc):
    return stats.norm().ppf(auc) * math.sqrt(2.0)


@torch.no_grad()
def evaluate(model, fbank, loader, n_total, device):
    model.eval()
    preds, targets, idxs = [], [], []
    for wav, y, idx in loader:
        logits = model(fbank(wav.to(device, non_blocking=True)))
        preds.append(torch.sigmoid(logits.float()))
        targets.append(y.to(device))
        idxs.append(idx.to(device))
    local = [torch.cat(preds), torch.cat(targets), torch.cat(idxs)]
    world = dist.get_world_size()
    gathered = []
    for t in local:
        out = t.new_empty((world * t.size(0),) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous())
        gathered.append(out)
    p, y, idx = (g.cpu().numpy() for g in gathered)
    # DistributedSampler pads by repeating samples; keep each clip once
    _, first = np.unique(idx, return_index=True)
    p, y = p[first], y[first]
    assert len(p) == n_total
    stats_t = torch.zeros(3, device=device)
    if dist.get_rank() == 0:
        valid = y.sum(0) > 0
        ap = average_precision_score(y[:, valid], p[:, valid], average=None)
        auc = roc_auc_score(y[:, valid], p[:, valid], average=None)
        stats_t[0], stats_t[1], stats_t[2] = float(np.mean(ap)), float(np.mean(auc)), float(d_prime(np.mean(auc)))
    dist.broadcast(stats_t, src=0)
    return stats_t.tolist()


def save_full(model, opt, path, epoch, best_map):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ocfg = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg, ocfg):
        model_sd = model.state_dict()
        optim_sd = FSDP.optim_state_dict(model, opt)
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd, "epoch": epoch, "best_map": best_map}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-json", required=True)
    ap.add_argument("--eval-json", required=True)
    ap.add_argument("--label-csv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=12, help="per GPU")
    ap.add_argument("--lr", type=float, default=1e-5, help="per 12x16 clips")
    ap.add_argument("--mixup", type=float, default=0.5)
    ap.add_argument("--workers", type=int, default=10)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    label_map = load_label_map(args.label_csv)
    train_set = AudioSetJson(args.train_json, label_map)
    eval_set = AudioSetJson(args.eval_json, label_map)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0, drop_last=True)
    eval_sampler = DistributedSampler(eval_set, shuffle=False)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, num_workers=args.workers,
                              pin_memory=True, drop_last=True, persistent_workers=True)
    eval_loader = DataLoader(eval_set, 48, sampler=eval_sampler, num_workers=args.workers, pin_memory=True)

    model = AST(num_classes=len(label_map))
    ckpt_path = os.path.join(args.out, "last.pt")
    ckpt = None
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
    fbank = Fbank().to(device)
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=local_rank,
        use_orig_params=True,
    )
    lr = args.lr * args.batch_size * world / (12 * 16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.95, 0.999), weight_decay=5e-7)
    start_epoch, best_map = 0, 0.0
    if ckpt is not None:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=False),
                                  FullOptimStateDictConfig(rank0_only=False)):
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, ckpt["optim"]))
        start_epoch, best_map = ckpt["epoch"] + 1, ckpt["best_map"]
        del ckpt

    total_steps = args.epochs * len(train_loader)
    warmup = 1000
    offset = start_epoch * len(train_loader)

    def lr_lambda(s):
        s = s + offset
        return min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)

    writer = None
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        writer = SummaryWriter(os.path.join(args.out, "tb"))

    step = start_epoch * len(train_loader)
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for wav, y, _ in train_loader:
            wav, y = wav.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = fbank(wav, augment=True)
            if args.mixup > 0 and np.random.rand() < args.mixup:
                lam = float(np.random.beta(10, 10))
                perm = torch.randperm(x.size(0), device=device)
                x = lam * x + (1 - lam) * x[perm]
                y = lam * y + (1 - lam) * y[perm]
            logits = model(x)
            loss = F.binary_cross_entropy_with_logits(logits.float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            model.clip_grad_norm_(10.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                loss_t = loss.detach().clone()
                dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)
                if writer is not None:
                    writer.add_scalar("train/loss", loss_t.item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

        mAP, mAUC, dp = evaluate(model, fbank, eval_loader, len(eval_set), device)
        if writer is not None:
            writer.add_scalar("eval/mAP", mAP, epoch)
            writer.add_scalar("eval/AUC", mAUC, epoch)
            writer.add_scalar("eval/d_prime", dp, epoch)
            print(f"epoch {epoch} mAP {mAP:.4f} AUC {mAUC:.4f} d' {dp:.3f} ({time.time() - t0:.0f}s)", flush=True)
        is_best = mAP > best_map
        best_map = max(best_map, mAP)
        save_full(model, opt, ckpt_path, epoch, best_map)
        if is_best and rank == 0:
            shutil.copyfile(ckpt_path, os.path.join(args.out, "best.pt"))
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
