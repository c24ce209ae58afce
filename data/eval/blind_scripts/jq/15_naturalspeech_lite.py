"""NaturalSpeech-lite: VITS backbone with a differentiable durator and a memory-based VAE prior.

Trainer keeps the newest `keep_ckpts` checkpoints in exp_dir and resumes from the last one.

    torchrun --nproc_per_node=8 15_naturalspeech_lite.py --config configs/ns_lite_ljs.yaml
"""
import argparse
import glob
import os
import re
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

import commons
from data_utils import DistributedBucketSampler, TextAudioCollate, TextAudioLoader
from losses import discriminator_loss, feature_loss, generator_loss, kl_loss
from mel_processing import mel_spectrogram_torch, spec_to_mel_torch
from models_ns import MultiPeriodDiscriminator, NaturalSpeechLite
from text.symbols import symbols


class Trainer:
    def __init__(self, cfg, exp_dir):
        self.cfg = cfg
        self.exp_dir = exp_dir
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        dist.init_process_group("nccl")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.device = torch.device("cuda", self.local_rank)
        torch.manual_seed(cfg["train"]["seed"])

        d = cfg["data"]
        self.train_set = TextAudioLoader(d["training_files"], d)
        self.sampler = DistributedBucketSampler(self.train_set, cfg["train"]["batch_size"],
                                                [32, 300, 400, 500, 600, 700, 800, 900, 1000],
                                                num_replicas=self.world, rank=self.rank, shuffle=True)
        self.loader = DataLoader(self.train_set, batch_sampler=self.sampler, collate_fn=TextAudioCollate(),
                                 num_workers=8, pin_memory=True)

        net_g = NaturalSpeechLite(len(symbols), d["filter_length"] // 2 + 1,
                                  cfg["train"]["segment_size"] // d["hop_length"], **cfg["model"]).to(self.device)
        net_d = MultiPeriodDiscriminator(cfg["model"]["use_spectral_norm"]).to(self.device)
        lr, betas, eps = cfg["train"]["learning_rate"], cfg["train"]["betas"], cfg["train"]["eps"]
        self.optim_g = torch.optim.AdamW(net_g.parameters(), lr, betas=betas, eps=eps)
        self.optim_d = torch.optim.AdamW(net_d.parameters(), lr, betas=betas, eps=eps)

        self.step, self.epoch = 0, 1
        last = self.latest_checkpoint()
        if last is not None:
            ckpt = torch.load(last, map_location="cpu")
            net_g.load_state_dict(ckpt["net_g"])
            net_d.load_state_dict(ckpt["net_d"])
            self.optim_g.load_state_dict(ckpt["optim_g"])
            self.optim_d.load_state_dict(ckpt["optim_d"])
            self.step, self.epoch = ckpt["step"], ckpt["epoch"] + 1
            if self.rank == 0:
                print(f"resumed {last} @ step {self.step}", flush=True)

        self.net_g = DDP(net_g, device_ids=[self.local_rank])
        self.net_d = DDP(net_d, device_ids=[self.local_rank])
        gamma = cfg["train"]["lr_decay"]
        self.sched_g = torch.optim.lr_scheduler.ExponentialLR(self.optim_g, gamma, last_epoch=self.epoch - 2)
        self.sched_d = torch.optim.lr_scheduler.ExponentialLR(self.optim_d, gamma, last_epoch=self.epoch - 2)
        self.writer = SummaryWriter(exp_dir) if self.rank == 0 else None

    # ------------------------------------------------------------------ checkpoints
    def latest_checkpoint(self):
        paths = glob.glob(os.path.join(self.exp_dir, "ckpt_*.pt"))
        if not paths:
            return None
        return max(paths, key=lambda p: int(re.search(r"ckpt_(\d+)\.pt$", p).group(1)))

    def save_checkpoint(self):
        if self.rank != 0:
            return
        path = os.path.join(self.exp_dir, f"ckpt_{self.step:08d}.pt")
        torch.save({"net_g": self.net_g.state_dict(), "net_d": self.net_d.state_dict(),
                    "optim_g": self.optim_g.state_dict(), "optim_d": self.optim_d.state_dict(),
                    "step": self.step, "epoch": self.epoch}, path + ".tmp")
        os.replace(path + ".tmp", path)
        old = sorted(glob.glob(os.path.join(self.exp_dir, "ckpt_*.pt")))[: -self.cfg["train"]["keep_ckpts"]]
        for p in old:
            os.remove(p)

    # ------------------------------------------------------------------ training
    def mel(self, wav):
        d = self.cfg["data"]
        return mel_spectrogram_torch(wav.squeeze(1), d["filter_length"], d["n_mel_channels"], d["sampling_rate"],
                                     d["hop_length"], d["win_length"], d["mel_fmin"], d["mel_fmax"])

    def train_step(self, batch):
        cfg_t, d = self.cfg["train"], self.cfg["data"]
        x, x_len, spec, spec_len, y, y_len = [t.to(self.device, non_blocking=True) for t in batch]
        (y_hat, loss_durator, ids_slice, z_mask,
         (z, z_p, m_p, logs_p, m_q, logs_q), loss_memory) = self.net_g(x, x_len, spec, spec_len)
        mel = spec_to_mel_torch(spec, d["filter_length"], d["n_mel_channels"], d["sampling_rate"],
                                d["mel_fmin"], d["mel_fmax"])
        y_mel = commons.slice_segments(mel, ids_slice, cfg_t["segment_size"] // d["hop_length"])
        y_hat_mel = self.mel(y_hat)
        y = commons.slice_segments(y, ids_slice * d["hop_length"], cfg_t["segment_size"])

        d_r, d_g, _, _ = self.net_d(y, y_hat.detach())
        loss_d, _, _ = discriminator_loss(d_r, d_g)
        self.optim_d.zero_grad(set_to_none=True)
        loss_d.backward()
        torch.nn.utils.clip_grad_norm_(self.net_d.parameters(), cfg_t["grad_clip"])
        self.optim_d.step()

        d_r, d_g, fmap_r, fmap_g = self.net_d(y, y_hat)
        loss_mel = F.l1_loss(y_mel, y_hat_mel) * cfg_t["c_mel"]
        loss_kl = kl_loss(z_p, logs_q, m_p, logs_p, z_mask) * cfg_t["c_kl"]
        loss_fm = feature_loss(fmap_r, fmap_g)
        loss_adv, _ = generator_loss(d_g)
        loss_g = loss_adv + loss_fm + loss_mel + loss_kl + loss_durator + cfg_t["c_memory"] * loss_memory
        self.optim_g.zero_grad(set_to_none=True)
        loss_g.backward()
        torch.nn.utils.clip_grad_norm_(self.net_g.parameters(), cfg_t["grad_clip"])
        self.optim_g.step()
        return {"d": loss_d, "g": loss_g, "adv": loss_adv, "fm": loss_fm, "mel": loss_mel, "kl": loss_kl,
                "dur": loss_durator, "mem": loss_memory}

    def fit(self):
        cfg_t = self.cfg["train"]
        while self.epoch <= cfg_t["epochs"]:
            self.sampler.set_epoch(self.epoch)
            self.net_g.train()
            self.net_d.train()
            t0 = time.time()
            for batch in self.loader:
                losses = self.train_step(batch)
                self.step += 1
                if self.rank == 0 and self.step % cfg_t["log_interval"] == 0:
                    for k, v in losses.items():
                        self.writer.add_scalar(f"train/{k}", v.item(), self.step)
                    self.writer.add_scalar("train/lr", self.optim_g.param_groups[0]["lr"], self.step)
                if self.step % cfg_t["save_interval"] == 0:
                    self.save_checkpoint()
                    if self.rank == 0:
                        self.log_sample()
            self.sched_g.step()
            self.sched_d.step()
            if self.rank == 0:
                print(f"epoch {self.epoch} step {self.step} ({time.time() - t0:.0f}s)", flush=True)
            self.epoch += 1
        self.save_checkpoint()
        dist.barrier()
        dist.destroy_process_group()

    @torch.no_grad()
    def log_sample(self):
        gen = self.net_g.module
        gen.eval()
        x, x_len, _, _, y, y_len = TextAudioCollate()([self.train_set[0]])
        y_hat, *_ = gen.infer(x.to(self.device), x_len.to(self.device), max_len=1000)
        self.writer.add_audio("sample/gen", y_hat[0].cpu(), self.step, self.cfg["data"]["sampling_rate"])
        gen.train()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--exp_dir", default="exp/ns_lite")
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    os.makedirs(args.exp_dir, exist_ok=True)
    Trainer(cfg, args.exp_dir).fit()


if __name__ == "__main__":
    main()
