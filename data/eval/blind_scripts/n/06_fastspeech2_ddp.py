# FastSpeech2 acoustic model, multi-GPU.
# Features come from preprocess.py (MFA durations, phoneme-level pitch/energy) in data/<name>/.
#   torchrun --nproc_per_node=4 06_fastspeech2_ddp.py -c configs/LJSpeech.yaml
import argparse
import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def pad_1d(xs, v=0):
    L = max(len(x) for x in xs)
    return np.stack([np.pad(x, (0, L - len(x)), constant_values=v) for x in xs])


def pad_2d(xs):
    L = max(x.shape[0] for x in xs)
    return np.stack([np.pad(x, ((0, L - x.shape[0]), (0, 0))) for x in xs])


class TTSDataset(Dataset):
    def __init__(self, root, split):
        self.root = root
        self.items = [l.strip().split("|") for l in open(os.path.join(root, f"{split}.txt"), encoding="utf-8")]
        with open(os.path.join(root, "symbols.json")) as f:
            self.sym = {s: i for i, s in enumerate(json.load(f))}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        base, phones = self.items[i][0], self.items[i][1]
        ids = np.array([self.sym[p] for p in phones.strip("{}").split()], dtype=np.int64)
        mel = np.load(os.path.join(self.root, "mel", f"{base}.npy"))
        pitch = np.load(os.path.join(self.root, "pitch", f"{base}.npy"))
        energy = np.load(os.path.join(self.root, "energy", f"{base}.npy"))
        dur = np.load(os.path.join(self.root, "duration", f"{base}.npy"))
        return ids, mel, pitch, energy, dur


def collate(batch):
    ids, mels, pitches, energies, durs = zip(*batch)
    src_lens = torch.tensor([len(x) for x in ids])
    mel_lens = torch.tensor([m.shape[0] for m in mels])
    return (torch.from_numpy(pad_1d(ids)), src_lens, torch.from_numpy(pad_2d(mels)).float(), mel_lens,
            torch.from_numpy(pad_1d(pitches)).float(), torch.from_numpy(pad_1d(energies)).float(),
            torch.from_numpy(pad_1d(durs)).long())


def mask_from_lens(lens, max_len=None):
    max_len = max_len or int(lens.max())
    return torch.arange(max_len, device=lens.device)[None, :] >= lens[:, None]


class FFTBlock(nn.Module):
    def __init__(self, d, heads, ff, k, p):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, dropout=p, batch_first=True)
        self.ln1 = nn.LayerNorm(d)
        self.conv = nn.Sequential(nn.Conv1d(d, ff, k, padding=k // 2), nn.ReLU(), nn.Conv1d(ff, d, 1))
        self.ln2 = nn.LayerNorm(d)
        self.drop = nn.Dropout(p)

    def forward(self, x, mask):
        a, _ = self.attn(x, x, x, key_padding_mask=mask)
        x = self.ln1(x + self.drop(a)).masked_fill(mask.unsqueeze(-1), 0)
        c = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.ln2(x + self.drop(c)).masked_fill(mask.unsqueeze(-1), 0)


class VariancePredictor(nn.Module):
    def __init__(self, d, f=256, k=3, p=0.5):
        super().__init__()
        self.c1 = nn.Conv1d(d, f, k, padding=k // 2)
        self.ln1 = nn.LayerNorm(f)
        self.c2 = nn.Conv1d(f, f, k, padding=k // 2)
        self.ln2 = nn.LayerNorm(f)
        self.out = nn.Linear(f, 1)
        self.drop = nn.Dropout(p)

    def forward(self, x, mask):
        x = self.drop(self.ln1(F.relu(self.c1(x.transpose(1, 2))).transpose(1, 2)))
        x = self.drop(self.ln2(F.relu(self.c2(x.transpose(1, 2))).transpose(1, 2)))
        return self.out(x).squeeze(-1).masked_fill(mask, 0.0)


class PostNet(nn.Module):
    def __init__(self, n_mels=80, ch=512, k=5, n=5):
        super().__init__()
        layers = []
        for i in range(n):
            cin = n_mels if i == 0 else ch
            cout = n_mels if i == n - 1 else ch
            layers += [nn.Conv1d(cin, cout, k, padding=k // 2), nn.BatchNorm1d(cout)]
            if i < n - 1:
                layers += [nn.Tanh(), nn.Dropout(0.5)]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x.transpose(1, 2)).transpose(1, 2)


class FastSpeech2(nn.Module):
    def __init__(self, n_symbols, cfg):
        super().__init__()
        d = cfg["d_model"]
        self.emb = nn.Embedding(n_symbols, d, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, 2000, d) * 0.02)
        self.encoder = nn.ModuleList([FFTBlock(d, 2, 1024, 9, 0.2) for _ in range(cfg["enc_layers"])])
        self.decoder = nn.ModuleList([FFTBlock(d, 2, 1024, 9, 0.2) for _ in range(cfg["dec_layers"])])
        self.dur = VariancePredictor(d)
        self.pitch = VariancePredictor(d)
        self.energy = VariancePredictor(d)
        self.pitch_emb = nn.Embedding(256, d)
        self.energy_emb = nn.Embedding(256, d)
        self.register_buffer("pitch_bins", torch.linspace(cfg["pitch_min"], cfg["pitch_max"], 255))
        self.register_buffer("energy_bins", torch.linspace(cfg["energy_min"], cfg["energy_max"], 255))
        self.mel_linear = nn.Linear(d, cfg["n_mels"])
        self.postnet = PostNet(cfg["n_mels"])

    @staticmethod
    def length_regulate(x, dur, max_len):
        out = [torch.repeat_interleave(xi, di, dim=0) for xi, di in zip(x, dur)]
        out = [F.pad(o, (0, 0, 0, max_len - o.shape[0])) for o in out]
        return torch.stack(out)

    def forward(self, ids, src_lens, mel_lens, pitch_t, energy_t, dur_t, use_postnet=True):
        src_mask = mask_from_lens(src_lens, ids.shape[1])
        x = self.emb(ids) + self.pos[:, : ids.shape[1]]
        for blk in self.encoder:
            x = blk(x, src_mask)
        log_dur = self.dur(x, src_mask)
        p = self.pitch(x, src_mask)
        e = self.energy(x, src_mask)
        x = x + self.pitch_emb(torch.bucketize(pitch_t, self.pitch_bins))
        x = x + self.energy_emb(torch.bucketize(energy_t, self.energy_bins))
        max_mel = int(mel_lens.max())
        x = self.length_regulate(x, dur_t, max_mel)
        mel_mask = mask_from_lens(mel_lens, max_mel)
        x = x + self.pos[:, :max_mel]
        for blk in self.decoder:
            x = blk(x, mel_mask)
        mel = self.mel_linear(x)
        post = mel + self.postnet(mel) if use_postnet else mel
        return mel, post, log_dur, p, e, src_mask, mel_mask


def fs2_loss(out, mel_t, pitch_t, energy_t, dur_t):
    mel, post, log_dur, p, e, src_mask, mel_mask = out
    keep_s, keep_m = ~src_mask, ~mel_mask
    mel_t = mel_t[:, : mel.shape[1]]
    l_mel = F.l1_loss(mel[keep_m], mel_t[keep_m])
    l_post = F.l1_loss(post[keep_m], mel_t[keep_m])
    l_dur = F.mse_loss(log_dur[keep_s], torch.log(dur_t.float() + 1)[keep_s])
    l_p = F.mse_loss(p[keep_s], pitch_t[keep_s])
    l_e = F.mse_loss(e[keep_s], energy_t[keep_s])
    return l_mel + l_post + l_dur + l_p + l_e, (l_mel, l_post, l_dur, l_p, l_e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--restore_step", type=int, default=0)
    args = ap.parse_args()
    cfg = yaml.safe_load(open(args.config))

    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)

    train_set = TTSDataset(cfg["path"]["preprocessed"], "train")
    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=cfg["train"]["batch_size"], sampler=sampler, collate_fn=collate,
                        num_workers=4, pin_memory=True, drop_last=True)

    model = FastSpeech2(len(train_set.sym), cfg["model"]).to(device)
    ckpt_dir = cfg["path"]["ckpt"]
    if args.restore_step:
        sd = torch.load(os.path.join(ckpt_dir, f"{args.restore_step}.pth.tar"), map_location=device)
        model.load_state_dict(sd["model"])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])

    opt = torch.optim.Adam(model.parameters(), lr=cfg["optim"]["lr"], betas=(0.9, 0.98), eps=1e-9)
    writer = SummaryWriter(cfg["path"]["log"]) if rank == 0 else None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    step, epoch = args.restore_step, 0
    total, postnet_start = cfg["train"]["total_step"], cfg["train"].get("postnet_start_step", 20000)
    while step < total:
        sampler.set_epoch(epoch)
        model.train()
        for ids, src_lens, mel, mel_lens, pitch, energy, dur in loader:
            ids, src_lens, mel, mel_lens = ids.to(device), src_lens.to(device), mel.to(device), mel_lens.to(device)
            pitch, energy, dur = pitch.to(device), energy.to(device), dur.to(device)
            out = model(ids, src_lens, mel_lens, pitch, energy, dur, use_postnet=step >= postnet_start)
            loss, parts = fs2_loss(out, mel, pitch, energy, dur)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lr = cfg["optim"]["lr"] * min((step + 1) ** -0.5, (step + 1) * cfg["optim"]["warmup"] ** -1.5) \
                * cfg["model"]["d_model"] ** 0.5
            for g in opt.param_groups:
                g["lr"] = lr
            opt.step()
            step += 1

            if rank == 0 and step % 100 == 0:
                names = ["mel", "postnet", "duration", "pitch", "energy"]
                writer.add_scalar("loss/total", loss.item(), step)
                for n, v in zip(names, parts):
                    writer.add_scalar(f"loss/{n}", v.item(), step)
                writer.add_scalar("lr", lr, step)
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step % cfg["train"]["save_step"] == 0:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()},
                               os.path.join(ckpt_dir, f"{step}.pth.tar"))
                dist.barrier()
            if step >= total:
                break
        epoch += 1

    if writer:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
