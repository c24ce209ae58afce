"""MelGAN with multi-scale discriminator and feature matching (distributed)."""
import argparse
import os
import time
from pathlib import Path

import librosa
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from librosa.filters import mel as librosa_mel_fn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import weight_norm
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--save_path", required=True)
    parser.add_argument("--load_path", default=None)
    parser.add_argument("--data_path", default="data/")
    parser.add_argument("--n_mel_channels", type=int, default=80)
    parser.add_argument("--ngf", type=int, default=32)
    parser.add_argument("--n_residual_layers", type=int, default=3)
    parser.add_argument("--ndf", type=int, default=16)
    parser.add_argument("--num_D", type=int, default=3)
    parser.add_argument("--n_layers_D", type=int, default=4)
    parser.add_argument("--downsamp_factor", type=int, default=4)
    parser.add_argument("--lambda_feat", type=float, default=10)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=3000)
    parser.add_argument("--log_interval", type=int, default=100)
    parser.add_argument("--save_interval", type=int, default=1000)
    parser.add_argument("--n_test_samples", type=int, default=8)
    return parser.parse_args()


class Audio2Mel(nn.Module):
    def __init__(self, n_fft=1024, hop_length=256, win_length=1024, sampling_rate=22050, n_mel_channels=80,
                 mel_fmin=0.0, mel_fmax=None):
        super().__init__()
        self.register_buffer("window", torch.hann_window(win_length).float())
        mel_basis = librosa_mel_fn(sr=sampling_rate, n_fft=n_fft, n_mels=n_mel_channels, fmin=mel_fmin, fmax=mel_fmax)
        self.register_buffer("mel_basis", torch.from_numpy(mel_basis).float())
        self.n_fft, self.hop_length, self.win_length = n_fft, hop_length, win_length

    def forward(self, audio):
        p = (self.n_fft - self.hop_length) // 2
        audio = F.pad(audio, (p, p), "reflect").squeeze(1)
        fft = torch.stft(audio, self.n_fft, self.hop_length, self.win_length, self.window,
                         center=False, return_complex=True)
        mel = torch.matmul(self.mel_basis, fft.abs())
        return torch.log10(torch.clamp(mel, min=1e-5))


class AudioDataset(Dataset):
    def __init__(self, file_list, segment_length, sampling_rate=22050, augment=True):
        with open(file_list) as f:
            self.files = [Path(l.strip()) for l in f if l.strip()]
        self.segment_length, self.sampling_rate, self.augment = segment_length, sampling_rate, augment

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        data, _ = librosa.load(self.files[i], sr=self.sampling_rate)
        data = 0.95 * librosa.util.normalize(data)
        if self.augment:
            data = data * np.random.uniform(0.3, 1.0)
        audio = torch.from_numpy(data).float()
        if audio.size(0) >= self.segment_length:
            start = np.random.randint(0, audio.size(0) - self.segment_length + 1)
            audio = audio[start:start + self.segment_length]
        else:
            audio = F.pad(audio, (0, self.segment_length - audio.size(0)))
        return audio.unsqueeze(0)


def WNConv1d(*a, **k):
    return weight_norm(nn.Conv1d(*a, **k))


def WNConvTranspose1d(*a, **k):
    return weight_norm(nn.ConvTranspose1d(*a, **k))


class ResnetBlock(nn.Module):
    def __init__(self, dim, dilation=1):
        super().__init__()
        self.block = nn.Sequential(nn.LeakyReLU(0.2), nn.ReflectionPad1d(dilation),
                                   WNConv1d(dim, dim, 3, dilation=dilation), nn.LeakyReLU(0.2),
                                   WNConv1d(dim, dim, 1))
        self.shortcut = WNConv1d(dim, dim, 1)

    def forward(self, x):
        return self.shortcut(x) + self.block(x)


class MelGANGenerator(nn.Module):
    def __init__(self, input_size, ngf, n_residual_layers, ratios=(8, 8, 2, 2)):
        super().__init__()
        mult = int(2 ** len(ratios))
        layers = [nn.ReflectionPad1d(3), WNConv1d(input_size, mult * ngf, 7)]
        for r in ratios:
            layers += [nn.LeakyReLU(0.2),
                       WNConvTranspose1d(mult * ngf, mult * ngf // 2, r * 2, r, padding=r // 2 + r % 2,
                                         output_padding=r % 2)]
            layers += [ResnetBlock(mult * ngf // 2, dilation=3 ** j) for j in range(n_residual_layers)]
            mult //= 2
        layers += [nn.LeakyReLU(0.2), nn.ReflectionPad1d(3), WNConv1d(ngf, 1, 7), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x):
        return self.model(x)


class NLayerDiscriminator(nn.Module):
    def __init__(self, ndf, n_layers, downsampling_factor):
        super().__init__()
        model = nn.ModuleDict()
        model["layer_0"] = nn.Sequential(nn.ReflectionPad1d(7), WNConv1d(1, ndf, 15), nn.LeakyReLU(0.2, True))
        nf, stride = ndf, downsampling_factor
        for n in range(1, n_layers + 1):
            nf_prev, nf = nf, min(nf * stride, 1024)
            model[f"layer_{n}"] = nn.Sequential(
                WNConv1d(nf_prev, nf, stride * 10 + 1, stride, padding=stride * 5, groups=nf_prev // 4),
                nn.LeakyReLU(0.2, True))
        nf_prev, nf = nf, min(nf * 2, 1024)
        model[f"layer_{n_layers + 1}"] = nn.Sequential(WNConv1d(nf_prev, nf, 5, 1, padding=2), nn.LeakyReLU(0.2, True))
        model[f"layer_{n_layers + 2}"] = WNConv1d(nf, 1, 3, 1, padding=1)
        self.model = model

    def forward(self, x):
        results = []
        for _, layer in self.model.items():
            x = layer(x)
            results.append(x)
        return results


class MultiScaleDiscriminator(nn.Module):
    def __init__(self, num_D, ndf, n_layers, downsampling_factor):
        super().__init__()
        self.model = nn.ModuleDict({f"disc_{i}": NLayerDiscriminator(ndf, n_layers, downsampling_factor)
                                    for i in range(num_D)})
        self.downsample = nn.AvgPool1d(4, stride=2, padding=1, count_include_pad=False)

    def forward(self, x):
        results = []
        for _, disc in self.model.items():
            results.append(disc(x))
            x = self.downsample(x)
        return results


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    root = Path(args.save_path)

    netG = MelGANGenerator(args.n_mel_channels, args.ngf, args.n_residual_layers).to(device)
    netD = MultiScaleDiscriminator(args.num_D, args.ndf, args.n_layers_D, args.downsamp_factor).to(device)
    fft = Audio2Mel(n_mel_channels=args.n_mel_channels).to(device)
    optG = torch.optim.Adam(netG.parameters(), lr=1e-4, betas=(0.5, 0.9))
    optD = torch.optim.Adam(netD.parameters(), lr=1e-4, betas=(0.5, 0.9))

    start_epoch, steps = 0, 0
    if args.load_path and (Path(args.load_path) / "netG.pt").exists():
        ld = Path(args.load_path)
        netG.load_state_dict(torch.load(ld / "netG.pt", map_location=device))
        optG.load_state_dict(torch.load(ld / "optG.pt", map_location=device))
        netD.load_state_dict(torch.load(ld / "netD.pt", map_location=device))
        optD.load_state_dict(torch.load(ld / "optD.pt", map_location=device))
        meta = torch.load(ld / "meta.pt", map_location="cpu")
        start_epoch, steps = meta["epoch"] + 1, meta["steps"]

    netG = DDP(netG, device_ids=[local_rank])
    netD = DDP(netD, device_ids=[local_rank])

    train_set = AudioDataset(Path(args.data_path) / "train_files.txt", args.seq_len)
    test_set = AudioDataset(Path(args.data_path) / "test_files.txt", 22050 * 4, augment=False)
    train_sampler = DistributedSampler(train_set, shuffle=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, num_workers=4,
                              pin_memory=True, drop_last=True)

    writer = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(str(root))
        test_voc, test_audio = [], []
        for i in range(args.n_test_samples):
            x_t = test_set[i].unsqueeze(0).to(device)
            test_voc.append(fft(x_t))
            test_audio.append(x_t)
            writer.add_audio(f"original/sample_{i}.wav", x_t.squeeze().cpu(), 0, sample_rate=22050)

    best_mel_reconst = 1e6
    costs = []
    t0 = time.time()
    for epoch in range(start_epoch, args.epochs):
        for x_t in train_loader:
            x_t = x_t.to(device, non_blocking=True)
            s_t = fft(x_t).detach()
            x_pred_t = netG(s_t)
            with torch.no_grad():
                s_pred_t = fft(x_pred_t.detach())
                s_error = F.l1_loss(s_t, s_pred_t).item()

            # discriminator
            D_fake_det = netD(x_pred_t.detach())
            D_real = netD(x_t)
            loss_D = 0
            for scale in D_fake_det:
                loss_D += F.relu(1 + scale[-1]).mean()
            for scale in D_real:
                loss_D += F.relu(1 - scale[-1]).mean()
            netD.zero_grad()
            loss_D.backward()
            optD.step()

            # generator
            D_fake = netD(x_pred_t)
            loss_G = sum(-scale[-1].mean() for scale in D_fake)
            loss_feat = 0
            feat_weights = 4.0 / (args.n_layers_D + 1)
            D_weights = 1.0 / args.num_D
            wt = D_weights * feat_weights
            for i in range(args.num_D):
                for j in range(len(D_fake[i]) - 1):
                    loss_feat += wt * F.l1_loss(D_fake[i][j], D_real[i][j].detach())
            netG.zero_grad()
            (loss_G + args.lambda_feat * loss_feat).backward()
            optG.step()

            costs.append([loss_D.item(), loss_G.item(), loss_feat.item(), s_error])
            steps += 1

            if steps % args.save_interval == 0 and rank == 0:
                st = time.time()
                g = netG.module
                g.eval()
                with torch.no_grad():
                    mel_err = 0.0
                    for i, (voc, x_ref) in enumerate(zip(test_voc, test_audio)):
                        pred = g(voc)
                        n = min(pred.size(-1), x_ref.size(-1))
                        mel_err += F.l1_loss(fft(pred[..., :n]), fft(x_ref[..., :n])).item()
                        writer.add_audio(f"generated/sample_{i}.wav", pred.squeeze().cpu(), epoch, sample_rate=22050)
                g.train()
                mel_err /= len(test_voc)
                writer.add_scalar("test/mel_reconstruction", mel_err, steps)
                torch.save(netG.module.state_dict(), root / "netG.pt")
                torch.save(optG.state_dict(), root / "optG.pt")
                torch.save(netD.module.state_dict(), root / "netD.pt")
                torch.save(optD.state_dict(), root / "optD.pt")
                torch.save({"epoch": epoch, "steps": steps}, root / "meta.pt")
                if mel_err < best_mel_reconst:
                    best_mel_reconst = mel_err
                    torch.save(netG.module.state_dict(), root / "best_netG.pt")
                print(f"Took {time.time() - st:5.2f}s to generate samples and save model")

            if steps % args.log_interval == 0:
                means = torch.tensor(costs, device=device).mean(0)
                dist.all_reduce(means)
                means /= dist.get_world_size()
                if rank == 0:
                    for name, v in zip(("loss/discriminator", "loss/generator", "loss/feature_matching",
                                        "loss/mel_reconstruction"), means.tolist()):
                        writer.add_scalar(name, v, steps)
                    print(f"Epoch {epoch} | Iters {steps} | ms/batch {1000 * (time.time() - t0) / args.log_interval:5.2f}"
                          f" | loss {means.tolist()}")
                costs = []
                t0 = time.time()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
