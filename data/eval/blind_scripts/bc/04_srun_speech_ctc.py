"""Conformer-CTC acoustic model training.

Submitted with scripts/train_ctc.sbatch:

    #SBATCH --nodes=4
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=12
    #SBATCH --requeue
    srun python train_ctc.py --config conf/conformer_m.yaml
"""
import argparse
import json
import os
import subprocess
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from asr.data import ManifestDataset, collate_audio
from asr.metrics import edit_distance
from asr.text import CharTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--exp-dir", default="/gpfs/exp/asr/conformer_m")
    p.add_argument("--resume", action="store_true", default=True)
    return p.parse_args()


def init_distributed():
    rank = int(os.environ["SLURM_PROCID"])
    world_size = int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if "MASTER_ADDR" not in os.environ:
        hosts = subprocess.check_output(
            ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]], text=True
        ).split()
        os.environ["MASTER_ADDR"] = hosts[0]
    os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    return rank, world_size, local_rank


class ConformerCTC(nn.Module):
    def __init__(self, n_mels, d_model, n_heads, ffn, n_layers, vocab):
        super().__init__()
        self.subsample = nn.Sequential(
            nn.Conv2d(1, d_model, 3, stride=2), nn.ReLU(),
            nn.Conv2d(d_model, d_model, 3, stride=2), nn.ReLU(),
        )
        self.proj = nn.Linear(d_model * (((n_mels - 1) // 2 - 1) // 2), d_model)
        self.encoder = torchaudio.models.Conformer(
            input_dim=d_model, num_heads=n_heads, ffn_dim=ffn, num_layers=n_layers,
            depthwise_conv_kernel_size=31, dropout=0.1,
        )
        self.out = nn.Linear(d_model, vocab)

    def forward(self, feats, lengths):
        x = self.subsample(feats.unsqueeze(1))  # B, C, T', F'
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lengths = ((lengths - 1) // 2 - 1) // 2
        lengths = lengths.clamp(max=t)
        x, lengths = self.encoder(x, lengths)
        return self.out(x).log_softmax(-1), lengths


def greedy_decode(log_probs, lengths, blank=0):
    hyps = []
    best = log_probs.argmax(-1).cpu()
    for seq, n in zip(best, lengths.cpu()):
        seq = torch.unique_consecutive(seq[:n])
        hyps.append([int(t) for t in seq if t != blank])
    return hyps


@torch.no_grad()
def evaluate(model, loader, tokenizer, device):
    model.eval()
    errs = torch.zeros(2, dtype=torch.float64, device=device)
    for feats, feat_lens, targets, target_lens in loader:
        feats, feat_lens = feats.to(device), feat_lens.to(device)
        log_probs, out_lens = model(feats, feat_lens)
        for hyp, ref, n in zip(greedy_decode(log_probs, out_lens), targets, target_lens):
            ref_ids = ref[:n].tolist()
            errs[0] += edit_distance(tokenizer.decode(hyp).split(), tokenizer.decode(ref_ids).split())
            errs[1] += len(tokenizer.decode(ref_ids).split())
    dist.all_reduce(errs)
    model.train()
    return (errs[0] / errs[1]).item()


def main():
    args = parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    rank, world, local_rank = init_distributed()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    tokenizer = CharTokenizer(cfg["data"]["vocab"])
    train_ds = ManifestDataset(cfg["data"]["train_manifest"], n_mels=cfg["model"]["n_mels"],
                               max_duration=cfg["data"]["max_duration"], spec_augment=True)
    dev_ds = ManifestDataset(cfg["data"]["dev_manifest"], n_mels=cfg["model"]["n_mels"])
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"])
    train_loader = DataLoader(train_ds, batch_size=cfg["train"]["batch_size"], sampler=sampler,
                              collate_fn=collate_audio, num_workers=8, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(Subset(dev_ds, range(rank, len(dev_ds), world)), batch_size=16,
                            collate_fn=collate_audio, num_workers=4)

    m = cfg["model"]
    model = ConformerCTC(m["n_mels"], m["d_model"], m["n_heads"], m["ffn"], m["n_layers"],
                         tokenizer.vocab_size).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["train"]["peak_lr"],
                                  betas=(0.9, 0.98), weight_decay=1e-3)
    warmup = cfg["train"]["warmup_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, (warmup / (s + 1)) ** 0.5)
    )

    ckpt_path = os.path.join(args.exp_dir, "last.pt")
    start_epoch, step, best_wer = 0, 0, float("inf")
    if args.resume and os.path.exists(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location=device)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, step, best_wer = ckpt["epoch"] + 1, ckpt["step"], ckpt["best_wer"]
        if rank == 0:
            print(f"resumed from epoch {ckpt['epoch']} (step {step})", flush=True)

    if rank == 0:
        os.makedirs(args.exp_dir, exist_ok=True)
        log_f = open(os.path.join(args.exp_dir, "train_log.jsonl"), "a")

    for epoch in range(start_epoch, cfg["train"]["epochs"]):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for feats, feat_lens, targets, target_lens in train_loader:
            feats, feat_lens = feats.to(device, non_blocking=True), feat_lens.to(device)
            targets, target_lens = targets.to(device), target_lens.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                log_probs, out_lens = model(feats, feat_lens)
            loss = ctc(log_probs.float().transpose(0, 1), targets, out_lens, target_lens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    rec = {"step": step, "epoch": epoch, "loss": l.item(), "gnorm": gnorm.item(),
                           "lr": scheduler.get_last_lr()[0], "elapsed": time.time() - t0}
                    log_f.write(json.dumps(rec) + "\n")
                    log_f.flush()

        wer = evaluate(model.module, dev_loader, tokenizer, device)
        if rank == 0:
            log_f.write(json.dumps({"epoch": epoch, "dev_wer": wer}) + "\n")
            log_f.flush()
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,
                     "best_wer": min(best_wer, wer)}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if wer < best_wer:
                torch.save(model.module.state_dict(), os.path.join(args.exp_dir, "best.pt"))
        best_wer = min(best_wer, wer)
        dist.barrier()

    if rank == 0:
        log_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
