# DiffWave vocoder, multi-GPU training.
#   torchrun --nproc_per_node=4 08_diffwave_train.py runs/diffwave data/LJSpeech-1.1/wavs
import argparse
import os
from glob import glob
from math import sqrt

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm


class AttrDict(dict):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.__dict__ = self


params = AttrDict(
    batch_size=16,
    learning_rate=2e-4,
    max_grad_norm=None,
    sample_rate=22050,
    n_mels=80,
    n_fft=1024,
    hop_samples=256,
    crop_mel_frames=62,
    residual_channels=64,
    residual_layers=30,
    dilation_cycle_length=10,
    noise_schedule=np.linspace(1e-4, 0.05, 50).tolist(),
    checkpoint_every=5000,
    summary_every=100,
)


class ConditionalDataset(Dataset):
    """Reads <wav> and the <wav>.spec.npy written by preprocess.py."""

    def __init__(self, paths):
        self.filenames = []
        for p in paths:
            self.filenames += glob(f"{p}/**/*.wav", recursive=True)
        self.filenames.sort()

    def __len__(self):
        return len(self.filenames)

    def __getitem__(self, idx):
        audio_filename = self.filenames[idx]
        signal, _ = torchaudio.load(audio_filename)
        spectrogram = np.load(f"{audio_filename}.spec.npy")
        return {"audio": signal[0], "spectrogram": spectrogram.T}


class Collator:
    def __init__(self, params):
        self.params = params

    def collate(self, minibatch):
        samples_per_frame = self.params.hop_samples
        out = []
        for record in minibatch:
            if len(record["spectrogram"]) < self.params.crop_mel_frames:
                continue
            start = np.random.randint(0, record["spectrogram"].shape[0] - self.params.crop_mel_frames)
            end = start + self.params.crop_mel_frames
            spec = record["spectrogram"][start:end].T
            s, e = start * samples_per_frame, end * samples_per_frame
            audio = record["audio"][s:e]
            audio = np.pad(audio, (0, (e - s) - len(audio)), mode="constant")
            out.append((audio, spec))
        audio = torch.from_numpy(np.stack([o[0] for o in out]))
        spectrogram = torch.from_numpy(np.stack([o[1] for o in out]))
        return {"audio": audio, "spectrogram": spectrogram}


class DiffusionEmbedding(nn.Module):
    def __init__(self, max_steps):
        super().__init__()
        self.register_buffer("embedding", self._build_embedding(max_steps), persistent=False)
        self.projection1 = nn.Linear(128, 512)
        self.projection2 = nn.Linear(512, 512)

    def forward(self, diffusion_step):
        x = self.embedding[diffusion_step]
        x = F.silu(self.projection1(x))
        return F.silu(self.projection2(x))

    @staticmethod
    def _build_embedding(max_steps):
        steps = torch.arange(max_steps).unsqueeze(1)
        dims = torch.arange(64).unsqueeze(0)
        table = steps * 10.0 ** (dims * 4.0 / 63.0)
        return torch.cat([torch.sin(table), torch.cos(table)], dim=1)


class SpectrogramUpsampler(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.ConvTranspose2d(1, 1, [3, 32], stride=[1, 16], padding=[1, 8])
        self.conv2 = nn.ConvTranspose2d(1, 1, [3, 32], stride=[1, 16], padding=[1, 8])

    def forward(self, x):
        x = F.leaky_relu(self.conv1(x.unsqueeze(1)), 0.4)
        x = F.leaky_relu(self.conv2(x), 0.4)
        return x.squeeze(1)


class ResidualBlock(nn.Module):
    def __init__(self, n_mels, residual_channels, dilation):
        super().__init__()
        self.dilated_conv = nn.Conv1d(residual_channels, 2 * residual_channels, 3, padding=dilation, dilation=dilation)
        self.diffusion_projection = nn.Linear(512, residual_channels)
        self.conditioner_projection = nn.Conv1d(n_mels, 2 * residual_channels, 1)
        self.output_projection = nn.Conv1d(residual_channels, 2 * residual_channels, 1)

    def forward(self, x, diffusion_step, conditioner):
        d = self.diffusion_projection(diffusion_step).unsqueeze(-1)
        y = self.dilated_conv(x + d) + self.conditioner_projection(conditioner)
        gate, filt = torch.chunk(y, 2, dim=1)
        y = torch.sigmoid(gate) * torch.tanh(filt)
        residual, skip = torch.chunk(self.output_projection(y), 2, dim=1)
        return (x + residual) / sqrt(2.0), skip


class DiffWave(nn.Module):
    def __init__(self, params):
        super().__init__()
        self.params = params
        self.input_projection = nn.Conv1d(1, params.residual_channels, 1)
        self.diffusion_embedding = DiffusionEmbedding(len(params.noise_schedule))
        self.spectrogram_upsampler = SpectrogramUpsampler()
        self.residual_layers = nn.ModuleList([
            ResidualBlock(params.n_mels, params.residual_channels, 2 ** (i % params.dilation_cycle_length))
            for i in range(params.residual_layers)])
        self.skip_projection = nn.Conv1d(params.residual_channels, params.residual_channels, 1)
        self.output_projection = nn.Conv1d(params.residual_channels, 1, 1)
        nn.init.zeros_(self.output_projection.weight)

    def forward(self, audio, diffusion_step, spectrogram):
        x = F.relu(self.input_projection(audio.unsqueeze(1)))
        diffusion_step = self.diffusion_embedding(diffusion_step)
        spectrogram = self.spectrogram_upsampler(spectrogram)
        skip = None
        for layer in self.residual_layers:
            x, skip_connection = layer(x, diffusion_step, spectrogram)
            skip = skip_connection if skip is None else skip_connection + skip
        x = skip / sqrt(len(self.residual_layers))
        x = F.relu(self.skip_projection(x))
        return self.output_projection(x)


class DiffWaveLearner:
    def __init__(self, model_dir, model, dataset, optimizer, params, rank):
        self.model_dir = model_dir
        self.model = model
        self.dataset = dataset
        self.optimizer = optimizer
        self.params = params
        self.rank = rank
        self.step = 0
        self.scaler = torch.cuda.amp.GradScaler()
        beta = np.array(params.noise_schedule)
        noise_level = np.cumprod(1 - beta)
        self.noise_level = torch.tensor(noise_level.astype(np.float32))
        self.loss_fn = nn.L1Loss()
        self.summary_writer = None

    def state_dict(self):
        model_state = self.model.module.state_dict() if hasattr(self.model, "module") else self.model.state_dict()
        return {
            "step": self.step,
            "model": {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in model_state.items()},
            "optimizer": self.optimizer.state_dict(),
            "params": dict(self.params),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state_dict):
        model = self.model.module if hasattr(self.model, "module") else self.model
        model.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.scaler.load_state_dict(state_dict["scaler"])
        self.step = state_dict["step"]

    def save_to_checkpoint(self, filename="weights"):
        save_basename = f"{filename}-{self.step}.pt"
        save_name = f"{self.model_dir}/{save_basename}"
        link_name = f"{self.model_dir}/{filename}.pt"
        torch.save(self.state_dict(), save_name)
        if os.path.islink(link_name):
            os.unlink(link_name)
        os.symlink(save_basename, link_name)

    def restore_from_checkpoint(self, filename="weights"):
        try:
            checkpoint = torch.load(f"{self.model_dir}/{filename}.pt", map_location="cpu")
            self.load_state_dict(checkpoint)
            return True
        except FileNotFoundError:
            return False

    def train(self, max_steps=None):
        device = next(self.model.parameters()).device
        epoch = self.step // len(self.dataset)
        while True:
            self.dataset.sampler.set_epoch(epoch)
            it = tqdm(self.dataset, desc=f"Epoch {epoch}") if self.rank == 0 else self.dataset
            for features in it:
                if max_steps is not None and self.step >= max_steps:
                    return
                features = {k: v.to(device, non_blocking=True) for k, v in features.items()}
                loss = self.train_step(features)
                if torch.isnan(loss).any():
                    raise RuntimeError(f"Detected NaN loss at step {self.step}.")
                if self.rank == 0 and self.step % self.params.summary_every == 0:
                    self._write_summary(self.step, features, loss)
                if self.step % self.params.checkpoint_every == 0:
                    self.save_to_checkpoint()
                self.step += 1
            epoch += 1

    def train_step(self, features):
        for p in self.model.parameters():
            p.grad = None
        audio, spectrogram = features["audio"], features["spectrogram"]
        N = audio.shape[0]
        device = audio.device
        self.noise_level = self.noise_level.to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            t = torch.randint(0, len(self.params.noise_schedule), [N], device=device)
            noise_scale = self.noise_level[t].unsqueeze(1)
            noise = torch.randn_like(audio)
            noisy_audio = noise_scale ** 0.5 * audio + (1.0 - noise_scale) ** 0.5 * noise
            predicted = self.model(noisy_audio, t, spectrogram)
            loss = self.loss_fn(noise, predicted.squeeze(1))
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        self.grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.params.max_grad_norm or 1e9)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss

    def _write_summary(self, step, features, loss):
        writer = self.summary_writer or SummaryWriter(self.model_dir, purge_step=step)
        writer.add_audio("feature/audio", features["audio"][0], step, sample_rate=self.params.sample_rate)
        writer.add_image("feature/spectrogram", torch.flip(features["spectrogram"][:1], [1]), step)
        writer.add_scalar("train/loss", loss, step)
        writer.add_scalar("train/grad_norm", self.grad_norm, step)
        writer.flush()
        self.summary_writer = writer


def main():
    parser = argparse.ArgumentParser(description="train (or resume training) a DiffWave model")
    parser.add_argument("model_dir", help="directory in which to store model checkpoints and training logs")
    parser.add_argument("data_dirs", nargs="+", help="space separated list of directories from which to read .wav files")
    parser.add_argument("--max_steps", default=None, type=int)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.backends.cudnn.benchmark = True
    os.makedirs(args.model_dir, exist_ok=True)

    ds = ConditionalDataset(args.data_dirs)
    loader = DataLoader(ds, batch_size=params.batch_size, collate_fn=Collator(params).collate, shuffle=False,
                        num_workers=os.cpu_count() // dist.get_world_size(), sampler=DistributedSampler(ds),
                        pin_memory=True, drop_last=True)

    model = DiffWave(params).cuda(local_rank)
    model = DistributedDataParallel(model, device_ids=[local_rank])
    opt = torch.optim.Adam(model.parameters(), lr=params.learning_rate)
    learner = DiffWaveLearner(args.model_dir, model, loader, opt, params, rank)
    learner.restore_from_checkpoint()
    learner.train(max_steps=args.max_steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
