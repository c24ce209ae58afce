"""Multi-speaker FastSpeech2 on VCTK conditioned on pretrained d-vectors (GE2E), bf16 autocast, torchrun.

    torchrun --nproc_per_node=4 20_fastspeech2_vctk.py --config conf/fs2_vctk.yaml --exp exp/fs2_vctk_dvec
"""
import argparse
import math
import os
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from fs2.dataset import VCTKDataset, collate_fs2
from fs2.model import FastSpeech2
from fs2.vocoder import load_hifigan


class SpeakerAdapter(nn.Module):
    """Projects the 256-d GE2E d-vector to the encoder width and adds it to every phoneme."""

    def __init__(self, dvec_dim, d_model):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(dvec_dim, d_model), nn.Tanh(), nn.Linear(d_model, d_model))

    def forward(self, h, dvec):
        return h + self.proj(F.normalize(dvec, dim=-1)).unsqueeze(1)


class MultiSpeakerFS2(nn.Module):
    def __init__(self, cfg, n_vocab):
        super().__init__()
        self.fs2 = FastSpeech2(n_vocab=n_vocab, **cfg["model"])
        self.spk = SpeakerAdapter(cfg["dvec_dim"], cfg["model"]["d_model"])

    def forward(self, batch):
        h, src_mask = self.fs2.encode(batch["phones"], batch["phone_lens"])
        h = self.spk(h, batch["dvec"])
        return self.fs2.decode(h, src_mask, durations=batch["durations"], pitch=batch["pitch"],
                               energy=batch["energy"], mel_lens=batch["mel_lens"])


def compute_loss(out, batch):
    mel_mask = out["mel_mask"].unsqueeze(-1)
    src_mask = out["src_mask"]
    target = batch["mel"]
    l_mel = (F.l1_loss(out["mel"], target, reduction="none") * mel_mask).sum() / (mel_mask.sum() * target.size(-1))
    l_post = (F.l1_loss(out["postnet_mel"], target, reduction="none") * mel_mask).sum() / (mel_mask.sum() * target.size(-1))
    l_dur = (F.mse_loss(out["log_dur"], torch.log1p(batch["durations"].float()), reduction="none") * src_mask).sum() / src_mask.sum()
    l_pitch = (F.mse_loss(out["pitch"], batch["pitch"], reduction="none") * src_mask).sum() / src_mask.sum()
    l_energy = (F.mse_loss(out["energy"], batch["energy"], reduction="none") * src_mask).sum() / src_mask.sum()
    total = l_mel + l_post + l_dur + l_pitch + l_energy
    return total, {"mel": l_mel, "postnet": l_post, "duration": l_dur, "pitch": l_pitch, "energy": l_energy}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--exp", required=True)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg["seed"])

    train_set = VCTKDataset(cfg["data"]["train_list"], cfg["data"], dvec_dir=cfg["data"]["dvec_dir"])
    val_set = VCTKDataset(cfg["data"]["val_list"], cfg["data"], dvec_dir=cfg["data"]["dvec_dir"])
    sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    loader = DataLoader(train_set, batch_size=cfg["train"]["batch_size"], sampler=sampler, collate_fn=collate_fs2,
                        num_workers=8, pin_memory=True, drop_last=True, persistent_workers=True)

    model = MultiSpeakerFS2(cfg, train_set.n_vocab).to(device)
    ckpt_dir = os.path.join(args.exp, "ckpt")
    start_step = 0
    opt_state = None
    if args.resume and os.path.exists(os.path.join(ckpt_dir, "last.pt")):
        ckpt = torch.load(os.path.join(ckpt_dir, "last.pt"), map_location="cpu")
        model.load_state_dict(ckpt["model"])
        opt_state, start_step = ckpt["optimizer"], ckpt["step"]

    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["train"]["lr"], betas=(0.9, 0.98), weight_decay=0.01)
    if opt_state is not None:
        optimizer.load_state_dict(opt_state)
    warmup, total_steps = cfg["train"]["warmup_steps"], cfg["train"]["total_steps"]
    lr_lambda = lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda, last_epoch=start_step - 1 if start_step else -1)

    writer = None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.copy(args.config, os.path.join(args.exp, "config.yaml"))
        writer = SummaryWriter(os.path.join(args.exp, "tb"))

    step, epoch, best_val = start_step, 0, float("inf")
    while step < total_steps:
        sampler.set_epoch(epoch)
        model.train()
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(batch)
            loss, parts = compute_loss({k: v.float() for k, v in out.items()}, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = nn.utils.clip_grad_norm_(model.parameters(), cfg["train"]["grad_clip"])
            optimizer.step()
            scheduler.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                for k, v in parts.items():
                    writer.add_scalar(f"train/{k}", v.item(), step)
                writer.add_scalar("train/grad_norm", gnorm.item(), step)
                writer.add_scalar("train/lr", scheduler.get_last_lr()[0], step)

            if step % cfg["train"]["val_interval"] == 0:
                model.eval()
                sums = torch.zeros(2, device=device)
                with torch.no_grad():
                    for i in range(rank, len(val_set), world):
                        vb = {k: v.to(device) for k, v in collate_fs2([val_set[i]]).items()}
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            vout = model.module(vb)
                        _, vparts = compute_loss({k: v.float() for k, v in vout.items()}, vb)
                        sums += torch.stack([vparts["mel"], torch.ones((), device=device)])
                dist.all_reduce(sums)
                val_mel = (sums[0] / sums[1]).item()
                model.train()
                if rank == 0:
                    writer.add_scalar("val/mel_l1", val_mel, step)
                    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                    torch.save(state, os.path.join(ckpt_dir, "last.pt"))
                    if val_mel < best_val:
                        best_val = val_mel
                        torch.save(state, os.path.join(ckpt_dir, "best.pt"))
            if step >= total_steps:
                break
        epoch += 1

    if rank == 0:
        # export the best model with a vocoder sample for a quick listen
        final = MultiSpeakerFS2(cfg, train_set.n_vocab).to(device).eval()
        final.load_state_dict(torch.load(os.path.join(ckpt_dir, "best.pt"), map_location="cpu")["model"])
        torch.save(final.state_dict(), os.path.join(args.exp, "fs2_vctk_dvec.pt"))
        vocoder = load_hifigan(cfg["vocoder_ckpt"], device)
        with torch.no_grad():
            vb = {k: v.to(device) for k, v in collate_fs2([val_set[0]]).items()}
            wav = vocoder(final(vb)["postnet_mel"].transpose(1, 2)).squeeze()
        writer.add_audio("export/sample", wav.float().cpu(), step, cfg["data"]["sampling_rate"])
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
