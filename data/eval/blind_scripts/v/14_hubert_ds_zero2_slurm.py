"""HuBERT-large continued SSL pretraining on in-domain meeting audio (iteration 2 targets:
k-means 500 on layer-9 features of the iteration-1 model, precomputed per utterance).

Slurm, one task per GPU, DeepSpeed ZeRO-2 (no deepspeed launcher / pdsh on this cluster):

    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=8
    #SBATCH --gpus-per-node=8
    #SBATCH --cpus-per-task=10
    export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
    srun --cpu-bind=none python hubert_cpt.py \
        --manifest /lustre/meetings/train.tsv --labels /lustre/meetings/km500_it2 \
        --valid /lustre/meetings/valid.tsv --out /lustre/exp/hubert_l_meet_it2

Every task sees all 8 GPUs of its node and picks its own by SLURM_LOCALID.
"""
import argparse
import os

import deepspeed
import numpy as np
import soundfile as sf
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from torch.utils.tensorboard import SummaryWriter
from transformers import HubertModel
from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices


def slurm_to_torch_env():
    os.environ.setdefault("RANK", os.environ["SLURM_PROCID"])
    os.environ.setdefault("WORLD_SIZE", os.environ["SLURM_NTASKS"])
    os.environ.setdefault("LOCAL_RANK", os.environ["SLURM_LOCALID"])
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["SLURM_NTASKS_PER_NODE"])


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--init", default="facebook/hubert-large-ll60k")
    p.add_argument("--manifest", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--labels", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--n-clusters", type=int, default=500)
    p.add_argument("--crop", type=int, default=250_000, help="max samples per utterance (16 kHz)")
    p.add_argument("--micro-bs", type=int, default=6)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--save-every", type=int, default=5000)
    return p.parse_args()


class AudioWithUnits(Dataset):
    """tsv: first line = root dir, then `relpath<TAB>num_samples`; units in <labels>/<relpath>.npy (50 Hz)."""

    def __init__(self, tsv, label_dir, crop, train=True):
        with open(tsv) as f:
            self.root = f.readline().strip()
            self.items = [l.rstrip("\n").split("\t")[0] for l in f]
        self.label_dir, self.crop, self.train = label_dir, crop, train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        rel = self.items[i]
        wav, _ = sf.read(os.path.join(self.root, rel), dtype="float32")
        units = np.load(os.path.join(self.label_dir, os.path.splitext(rel)[0] + ".npy"))
        if len(wav) > self.crop:
            start = np.random.randint(0, len(wav) - self.crop + 1) if self.train else 0
            start -= start % 320                       # keep waveform and 20 ms frames aligned
            wav = wav[start : start + self.crop]
            units = units[start // 320 : start // 320 + self.crop // 320]
        wav = (wav - wav.mean()) / (wav.std() + 1e-7)
        return torch.from_numpy(wav), torch.from_numpy(units.astype(np.int64))


def collate(batch):
    n = min(w.numel() for w, _ in batch)               # crop to the shortest in the batch
    n -= n % 320
    wavs = torch.stack([w[:n] for w, _ in batch])
    units = torch.stack([u[: n // 320] for _, u in batch])
    return wavs, units


class HubertPretrain(nn.Module):
    def __init__(self, init, n_clusters):
        super().__init__()
        self.hubert = HubertModel.from_pretrained(init, mask_time_prob=0.0, layerdrop=0.0)
        self.hubert.feature_extractor._freeze_parameters()
        self.hubert.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        d = self.hubert.config.hidden_size
        self.proj = nn.Linear(d, 256)
        self.codebook = nn.Parameter(torch.randn(n_clusters, 256) * 0.02)

    def forward(self, wav, units):
        frames = self.hubert._get_feat_extract_output_lengths(wav.size(1))
        mask = _compute_mask_indices((wav.size(0), frames), mask_prob=0.8, mask_length=10, min_masks=2)
        mask = torch.from_numpy(mask).to(wav.device)
        h = self.hubert(wav, mask_time_indices=mask).last_hidden_state
        t = min(h.size(1), units.size(1))
        h, units, mask = h[:, :t], units[:, :t], mask[:, :t]
        logits = F.cosine_similarity(self.proj(h).unsqueeze(2), self.codebook[None, None], dim=-1) / 0.1
        loss = F.cross_entropy(logits[mask].float(), units[mask])
        acc = (logits[mask].argmax(-1) == units[mask]).float().sum()
        return loss, acc, mask.sum()


def main():
    args = get_args()
    slurm_to_torch_env()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.accum,
        "train_batch_size": args.micro_bs * args.accum * world,
        "gradient_clipping": 10.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                              "allgather_bucket_size": 2e8, "reduce_bucket_size": 2e8},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.98], "eps": 1e-6,
                                                  "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": 8000, "total_num_steps": args.steps}},
        "steps_per_print": 500,
    }

    model = HubertPretrain(args.init, args.n_clusters)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config)

    train_ds = AudioWithUnits(args.manifest, args.labels, args.crop, train=True)
    valid_ds = AudioWithUnits(args.valid, args.labels, args.crop, train=False)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=11)
    loader = DataLoader(train_ds, batch_size=args.micro_bs, sampler=sampler, collate_fn=collate,
                        num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)
    vloader = DataLoader(Subset(valid_ds, range(rank, len(valid_ds), world)), batch_size=args.micro_bs,
                         collate_fn=collate, num_workers=4)

    ckpt_dir = os.path.join(args.out, "checkpoints")
    epoch = 0
    if os.path.exists(os.path.join(ckpt_dir, "latest")):
        _, client = engine.load_checkpoint(ckpt_dir)
        epoch = client["epoch"]
    tb = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    micro = 0
    while engine.global_steps < args.steps:
        sampler.set_epoch(epoch)
        engine.train()
        for wav, units in loader:
            wav, units = wav.to(engine.device, non_blocking=True), units.to(engine.device, non_blocking=True)
            loss, _, _ = engine(wav.to(torch.bfloat16), units)
            engine.backward(loss)
            engine.step()
            micro += 1
            if micro % args.accum != 0:
                continue
            gs = engine.global_steps
            if tb is not None and gs % 100 == 0:
                tb.add_scalar("train/loss", loss.item(), gs)
                tb.add_scalar("train/lr", engine.get_lr()[0], gs)
            if gs % args.save_every == 0:
                engine.save_checkpoint(ckpt_dir, tag=f"step{gs}", client_state={"epoch": epoch})
                engine.eval()
                stats = torch.zeros(3, device=engine.device)
                with torch.no_grad():
                    for vw, vu in vloader:
                        l, c, n = engine(vw.to(engine.device, dtype=torch.bfloat16), vu.to(engine.device))
                        stats += torch.stack([l.float() * n, c, n.float()])
                dist.all_reduce(stats)
                if tb is not None:
                    tb.add_scalar("valid/loss", (stats[0] / stats[2]).item(), gs)
                    tb.add_scalar("valid/masked_acc", (stats[1] / stats[2]).item(), gs)
                engine.train()
            if gs >= args.steps:
                break
        epoch += 1

    engine.save_checkpoint(ckpt_dir, tag="final", client_state={"epoch": epoch})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
