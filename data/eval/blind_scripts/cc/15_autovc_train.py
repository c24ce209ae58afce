"""AutoVC-style many-to-many voice conversion (content bottleneck + speaker d-vectors).

Mels and d-vectors come from make_spect.py / make_metadata.py (one .npy per utterance,
one d-vector .npy per speaker).

    torchrun --nproc_per_node=4 15_autovc_train.py --data_dir spmel --save_dir runs/autovc
"""
import argparse
import os
import pickle
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.tensorboard import SummaryWriter


class Utterances(Dataset):
    def __init__(self, root, metadata, len_crop):
        with open(os.path.join(root, metadata), "rb") as f:
            meta = pickle.load(f)  # [(speaker, d_vector, [utt paths...]), ...]
        self.root, self.len_crop = root, len_crop
        self.items = [(np.asarray(emb, dtype=np.float32), utt) for spk, emb, utts in meta for utt in utts]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        emb, path = self.items[i]
        mel = np.load(os.path.join(self.root, path)).astype(np.float32)
        if mel.shape[0] < self.len_crop:
            mel = np.pad(mel, ((0, self.len_crop - mel.shape[0]), (0, 0)), "constant")
        elif mel.shape[0] > self.len_crop:
            s = np.random.randint(mel.shape[0] - self.len_crop)
            mel = mel[s:s + self.len_crop]
        return torch.from_numpy(mel), torch.from_numpy(emb)


class ConvNorm(nn.Sequential):
    def __init__(self, cin, cout, k=5, act=True):
        layers = [nn.Conv1d(cin, cout, k, padding=k // 2), nn.GroupNorm(1, cout)]
        if act:
            layers.append(nn.ReLU())
        super().__init__(*layers)


class Encoder(nn.Module):
    def __init__(self, dim_neck, dim_emb, freq, n_mels=80):
        super().__init__()
        self.dim_neck, self.freq = dim_neck, freq
        self.convs = nn.Sequential(ConvNorm(n_mels + dim_emb, 512), ConvNorm(512, 512), ConvNorm(512, 512))
        self.lstm = nn.LSTM(512, dim_neck, 2, batch_first=True, bidirectional=True)

    def forward(self, x, c_org):
        c = c_org.unsqueeze(-1).expand(-1, -1, x.size(-1))
        x = self.convs(torch.cat([x, c], 1)).transpose(1, 2)
        self.lstm.flatten_parameters()
        out, _ = self.lstm(x)
        fwd, bwd = out[:, :, :self.dim_neck], out[:, :, self.dim_neck:]
        codes = [torch.cat([fwd[:, i + self.freq - 1, :], bwd[:, i, :]], -1) for i in range(0, out.size(1), self.freq)]
        return codes


class Decoder(nn.Module):
    def __init__(self, dim_neck, dim_emb, dim_pre, n_mels=80):
        super().__init__()
        self.lstm1 = nn.LSTM(dim_neck * 2 + dim_emb, dim_pre, 1, batch_first=True)
        self.convs = nn.Sequential(ConvNorm(dim_pre, dim_pre), ConvNorm(dim_pre, dim_pre), ConvNorm(dim_pre, dim_pre))
        self.lstm2 = nn.LSTM(dim_pre, 1024, 2, batch_first=True)
        self.proj = nn.Linear(1024, n_mels)

    def forward(self, x):
        x, _ = self.lstm1(x)
        x = self.convs(x.transpose(1, 2)).transpose(1, 2)
        x, _ = self.lstm2(x)
        return self.proj(x)


class Postnet(nn.Module):
    def __init__(self, n_mels=80):
        super().__init__()
        self.convs = nn.ModuleList([ConvNorm(n_mels, 512)] + [ConvNorm(512, 512) for _ in range(3)]
                                   + [ConvNorm(512, n_mels, act=False)])

    def forward(self, x):
        for c in self.convs[:-1]:
            x = torch.tanh(c(x))
        return self.convs[-1](x)


class Generator(nn.Module):
    def __init__(self, dim_neck=32, dim_emb=256, dim_pre=512, freq=32):
        super().__init__()
        self.encoder = Encoder(dim_neck, dim_emb, freq)
        self.decoder = Decoder(dim_neck, dim_emb, dim_pre)
        self.postnet = Postnet()
        self.freq = freq

    def forward(self, x, c_org, c_trg):
        codes = self.encoder(x.transpose(1, 2), c_org)
        up = torch.cat([c.unsqueeze(1).expand(-1, self.freq, -1) for c in codes], 1)
        enc = torch.cat([up, c_trg.unsqueeze(1).expand(-1, x.size(1), -1)], -1)
        mel = self.decoder(enc)
        mel_post = mel + self.postnet(mel.transpose(1, 2)).transpose(1, 2)
        # content code of the reconstruction, for the code-consistency loss
        code_reconst = torch.cat(self.encoder(mel_post.transpose(1, 2), c_org), -1)
        return mel, mel_post, torch.cat(codes, -1), code_reconst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", default="spmel")
    ap.add_argument("--metadata", default="train.pkl")
    ap.add_argument("--save_dir", default="runs/autovc")
    ap.add_argument("--lambda_cd", type=float, default=1.0)
    ap.add_argument("--dim_neck", type=int, default=32)
    ap.add_argument("--dim_emb", type=int, default=256)
    ap.add_argument("--dim_pre", type=int, default=512)
    ap.add_argument("--freq", type=int, default=32)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--len_crop", type=int, default=128)
    ap.add_argument("--num_iters", type=int, default=1_000_000)
    ap.add_argument("--log_step", type=int, default=100)
    ap.add_argument("--save_step", type=int, default=10_000)
    ap.add_argument("--resume", default="")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    dataset = Utterances(args.data_dir, args.metadata, args.len_crop)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=4, drop_last=True,
                        pin_memory=True, persistent_workers=True)

    G = Generator(args.dim_neck, args.dim_emb, args.dim_pre, args.freq).to(device)
    opt = torch.optim.Adam(G.parameters(), 1e-4)
    start = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        G.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        start = ck["iteration"]
    G = DDP(G, device_ids=[local_rank])

    writer = None
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        writer = SummaryWriter(args.save_dir)

    data_iter, epoch = iter(loader), 0
    t0 = time.time()
    for it in range(start, args.num_iters):
        try:
            x_real, emb_org = next(data_iter)
        except StopIteration:
            epoch += 1
            data_iter = iter(loader)
            x_real, emb_org = next(data_iter)
        x_real, emb_org = x_real.to(device, non_blocking=True), emb_org.to(device, non_blocking=True)

        G.train()
        x_id, x_id_psnt, code_real, code_reconst = G(x_real, emb_org, emb_org)
        g_loss_id = F.mse_loss(x_real, x_id)
        g_loss_id_psnt = F.mse_loss(x_real, x_id_psnt)
        g_loss_cd = F.l1_loss(code_real, code_reconst)
        g_loss = g_loss_id + g_loss_id_psnt + args.lambda_cd * g_loss_cd

        opt.zero_grad()
        g_loss.backward()
        opt.step()

        if (it + 1) % args.log_step == 0:
            logs = torch.stack([g_loss_id.detach(), g_loss_id_psnt.detach(), g_loss_cd.detach()])
            dist.all_reduce(logs)
            logs /= world
            if rank == 0:
                el = time.time() - t0
                print(f"Elapsed [{el:.0f}s], Iteration [{it + 1}/{args.num_iters}], "
                      f"G/loss_id: {logs[0]:.4f}, G/loss_id_psnt: {logs[1]:.4f}, G/loss_cd: {logs[2]:.4f}")
                for k, v in zip(("G/loss_id", "G/loss_id_psnt", "G/loss_cd"), logs.tolist()):
                    writer.add_scalar(k, v, it + 1)

        if rank == 0 and (it + 1) % args.save_step == 0:
            G.eval()
            with torch.no_grad():
                # convert the first utterance of the batch to the voice of the second one
                _, conv, _, _ = G.module(x_real[:1], emb_org[:1], emb_org[1:2])
            writer.add_image("conversion/src", x_real[0].T.flip(0).unsqueeze(0).cpu(), it + 1)
            writer.add_image("conversion/out", conv[0].T.flip(0).unsqueeze(0).cpu(), it + 1)
            torch.save({"model": G.module.state_dict(), "optimizer": opt.state_dict(), "iteration": it + 1},
                       os.path.join(args.save_dir, f"autovc_{it + 1}.ckpt"))

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
