"""32 kHz music codec, 8 RVQ levels (4 kbps), long crops.

Evaluation on the held-out set reports mel distance and SI-SNR; the checkpoint with the
best mel distance is kept as `best.pt` and early stopping watches the same number.

    torchrun --nproc_per_node=8 18_music_codec_eval_best.py --config conf/music32k.yaml
"""
import argparse
import math
import os
import random

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


class MusicSegments(Dataset):
    def __init__(self, list_path, sr, seconds, train):
        with open(list_path) as f:
            self.files = [l.strip() for l in f if l.strip()]
        self.sr, self.n, self.train = sr, int(sr * seconds), train

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        info = torchaudio.info(self.files[i])
        need = int(self.n * info.sample_rate / self.sr) + 64
        start = random.randint(0, max(0, info.num_frames - need)) if self.train else max(0, (info.num_frames - need) // 2)
        x, sr = torchaudio.load(self.files[i], frame_offset=start, num_frames=need)
        x = torchaudio.functional.resample(x.mean(0, keepdim=True), sr, self.sr)[:, : self.n]
        return F.pad(x, (0, self.n - x.shape[-1]))


def conv_block(cin, cout, k, s=1):
    return nn.Sequential(nn.Conv1d(cin, cout, k, s, padding=(k - s + 1) // 2), nn.ELU())


class Residual(nn.Module):
    def __init__(self, ch, d):
        super().__init__()
        self.f = nn.Sequential(nn.ELU(), nn.Conv1d(ch, ch, 3, dilation=d, padding=d), nn.ELU(), nn.Conv1d(ch, ch, 1))

    def forward(self, x):
        return x + self.f(x)


class MusicCodec(nn.Module):
    def __init__(self, ch=48, dim=128, n_q=8, bins=2048, strides=(4, 5, 4, 4)):
        super().__init__()
        enc, c = [nn.Conv1d(1, ch, 7, padding=3)], ch
        for s in strides:
            enc += [Residual(c, 1), Residual(c, 3), Residual(c, 9), conv_block(c, 2 * c, 2 * s, s)]
            c *= 2
        enc += [nn.Conv1d(c, dim, 3, padding=1)]
        self.encoder = nn.Sequential(*enc)
        self.codebooks = nn.ModuleList(nn.Embedding(bins, dim) for _ in range(n_q))
        dec = [nn.Conv1d(dim, c, 7, padding=3)]
        for s in reversed(strides):
            dec += [nn.ELU(), nn.ConvTranspose1d(c, c // 2, 2 * s, s, padding=s // 2),
                    Residual(c // 2, 1), Residual(c // 2, 3), Residual(c // 2, 9)]
            c //= 2
        dec += [nn.ELU(), nn.Conv1d(c, 1, 7, padding=3)]
        self.decoder = nn.Sequential(*dec)

    def forward(self, x):
        z = self.encoder(x).transpose(1, 2)  # [B, T, D]
        res, zq, commit = z, 0.0, 0.0
        for cb in self.codebooks:
            d = (res.pow(2).sum(-1, keepdim=True) - 2 * res @ cb.weight.t() + cb.weight.pow(2).sum(-1))
            q = cb(d.argmin(-1))
            commit = commit + F.mse_loss(q, res.detach()) + 0.25 * F.mse_loss(res, q.detach())
            q = res + (q - res).detach()
            zq, res = zq + q, res - q.detach()
        return self.decoder(zq.transpose(1, 2))[..., : x.shape[-1]], commit / len(self.codebooks)


class MelDistance(nn.Module):
    def __init__(self, sr):
        super().__init__()
        self.mels = nn.ModuleList(torchaudio.transforms.MelSpectrogram(sr, n_fft=n, hop_length=n // 4, n_mels=m)
                                  for n, m in ((256, 32), (512, 64), (1024, 80), (2048, 128), (4096, 128)))

    def forward(self, x, y):
        return sum(F.l1_loss(m(x).clamp(min=1e-5).log10(), m(y).clamp(min=1e-5).log10()) for m in self.mels) / len(self.mels)


def si_snr(est, ref, eps=1e-8):
    est, ref = est - est.mean(-1, keepdim=True), ref - ref.mean(-1, keepdim=True)
    proj = (est * ref).sum(-1, keepdim=True) * ref / (ref.pow(2).sum(-1, keepdim=True) + eps)
    return 10 * torch.log10(proj.pow(2).sum(-1) / ((est - proj).pow(2).sum(-1) + eps) + eps)


@torch.no_grad()
def evaluate(net, loader, mel_dist, device):
    net.eval()
    mel_sum, snr_sum, n = 0.0, 0.0, 0
    for x in loader:
        x = x.to(device)
        y, _ = net(x)
        mel_sum += mel_dist(y, x).item() * x.shape[0]
        snr_sum += si_snr(y.squeeze(1), x.squeeze(1)).sum().item()
        n += x.shape[0]
    net.train()
    return {"mel": mel_sum / max(n, 1), "si_snr": snr_sum / max(n, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    cfg = yaml.safe_load(open(ap.parse_args().config))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])

    sr = cfg["sample_rate"]
    train_ds = MusicSegments(cfg["train_list"], sr, cfg["train_seconds"], True)
    valid_ds = MusicSegments(cfg["valid_list"], sr, cfg["valid_seconds"], False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, cfg["batch_size"] // world, sampler=train_sampler,
                          num_workers=cfg["workers"], pin_memory=True, drop_last=True, persistent_workers=True)
    valid_dl = DataLoader(valid_ds, 4, sampler=DistributedSampler(valid_ds, shuffle=False), num_workers=2)

    model = DDP(MusicCodec().to(device), device_ids=[local_rank])
    mel_dist = MelDistance(sr).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], betas=(0.5, 0.9))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg["warmup"]))

    out = cfg["out_dir"]
    if rank == 0:
        os.makedirs(out, exist_ok=True)
    writer = SummaryWriter(os.path.join(out, "tb")) if rank == 0 else None
    best, bad_evals, step, epoch = math.inf, 0, 0, 0
    stop = torch.zeros(1, device=device)
    while step < cfg["max_steps"] and stop.item() == 0:
        train_sampler.set_epoch(epoch)
        for x in train_dl:
            x = x.to(device, non_blocking=True)
            y, commit = model(x)
            mel = mel_dist(y, x)
            loss = mel + 0.1 * F.l1_loss(y, x) + commit
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            step += 1

            if step % 100 == 0:
                rep = torch.stack([mel.detach(), commit.detach()])
                dist.all_reduce(rep, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/mel", rep[0].item(), step)
                    writer.add_scalar("train/commit", rep[1].item(), step)

            if step % cfg["eval_every"] == 0:
                metrics = evaluate(model.module, valid_dl, mel_dist, device)
                if rank == 0:
                    for k, v in metrics.items():
                        writer.add_scalar(f"valid/{k}", v, step)
                    print(f"step {step} valid mel {metrics['mel']:.4f} si-snr {metrics['si_snr']:.2f} dB", flush=True)
                    state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}
                    torch.save(state, os.path.join(out, "last.pt"))
                    if metrics["mel"] < best:
                        best, bad_evals = metrics["mel"], 0
                        torch.save(state, os.path.join(out, "best.pt"))
                    else:
                        bad_evals += 1
                    stop.fill_(float(bad_evals >= cfg["patience"]))
                dist.broadcast(stop, src=0)
                if stop.item():
                    break
            if step >= cfg["max_steps"]:
                break
        epoch += 1

    if rank == 0:
        print(f"done at step {step}, best valid mel {best:.4f}", flush=True)
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
