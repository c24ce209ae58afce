"""GE2E speaker encoder (3-layer LSTM, 256-d d-vectors) used for speaker conditioning of multi-speaker TTS.

torchrun --nproc_per_node=4 17_speaker_encoder_ge2e.py --data_root data/SV2TTS/encoder --run_id ge2e_vox
"""
import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from scipy.interpolate import interp1d
from scipy.optimize import brentq
from sklearn.metrics import roc_curve
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter

MEL_N_CHANNELS = 40
PARTIAL_FRAMES = 160


class SpeakerEncoder(nn.Module):
    def __init__(self, hidden=256, emb=256, layers=3):
        super().__init__()
        self.lstm = nn.LSTM(MEL_N_CHANNELS, hidden, num_layers=layers, batch_first=True)
        self.linear = nn.Linear(hidden, emb)
        self.similarity_weight = nn.Parameter(torch.tensor([10.0]))
        self.similarity_bias = nn.Parameter(torch.tensor([-5.0]))

    def forward(self, utterances):
        _, (hidden, _) = self.lstm(utterances)
        embeds_raw = F.relu(self.linear(hidden[-1]))
        return embeds_raw / (torch.norm(embeds_raw, dim=1, keepdim=True) + 1e-5)

    def ge2e_loss(self, embeds):
        """embeds: (speakers, utterances, dim)"""
        n_spk, n_utt = embeds.shape[:2]
        centroids_incl = F.normalize(embeds.mean(dim=1, keepdim=True), dim=2)
        centroids_excl = (embeds.sum(dim=1, keepdim=True) - embeds) / (n_utt - 1)
        centroids_excl = F.normalize(centroids_excl, dim=2)

        sim = torch.einsum("sud,kd->suk", embeds, centroids_incl.squeeze(1))
        own = (embeds * centroids_excl).sum(dim=2)
        idx = torch.arange(n_spk, device=embeds.device)
        sim[idx, :, idx] = own
        sim = sim * self.similarity_weight + self.similarity_bias
        sim = sim.reshape(n_spk * n_utt, n_spk)
        target = idx.repeat_interleave(n_utt)
        loss = F.cross_entropy(sim, target)

        with torch.no_grad():
            labels = F.one_hot(target, n_spk).cpu().numpy().ravel()
            preds = sim.detach().float().cpu().numpy().ravel()
            fpr, tpr, _ = roc_curve(labels, preds)
            eer = brentq(lambda x: 1.0 - x - interp1d(fpr, tpr)(x), 0.0, 1.0)
        return loss, eer


class SpeakerUtterances(Dataset):
    """One item = one speaker: `utts_per_speaker` random partial mel segments from that speaker's frames_*.npy."""

    def __init__(self, root, utts_per_speaker):
        self.speaker_dirs = sorted(p for p in Path(root).glob("*") if p.is_dir())
        self.utts_per_speaker = utts_per_speaker
        self.files = [sorted(d.glob("frames_*.npy")) for d in self.speaker_dirs]

    def __len__(self):
        return len(self.speaker_dirs)

    def __getitem__(self, i):
        files = self.files[i]
        picks = np.random.choice(len(files), self.utts_per_speaker, replace=len(files) < self.utts_per_speaker)
        segs = []
        for j in picks:
            frames = np.load(files[j], mmap_mode="r")
            if frames.shape[0] <= PARTIAL_FRAMES:
                frames = np.pad(frames, ((0, PARTIAL_FRAMES - frames.shape[0] + 1), (0, 0)))
            start = np.random.randint(0, frames.shape[0] - PARTIAL_FRAMES)
            segs.append(np.asarray(frames[start:start + PARTIAL_FRAMES]))
        return torch.from_numpy(np.stack(segs)).float()


def seed_worker(worker_id):
    np.random.seed((torch.initial_seed() + worker_id) % 2 ** 32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_root", required=True)
    ap.add_argument("--val_root", default=None)
    ap.add_argument("--run_id", required=True)
    ap.add_argument("--models_dir", default="saved_models")
    ap.add_argument("--speakers_per_batch", type=int, default=64, help="per GPU")
    ap.add_argument("--utterances_per_speaker", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--save_every", type=int, default=10)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)
    np.random.seed(1000 + rank)

    dataset = SpeakerUtterances(args.data_root, args.utterances_per_speaker)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.speakers_per_batch, sampler=sampler, num_workers=8,
                        drop_last=True, pin_memory=True, persistent_workers=True,
                        worker_init_fn=seed_worker)
    val_loader = None
    if args.val_root:
        val_set = SpeakerUtterances(args.val_root, args.utterances_per_speaker)
        val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
        val_loader = DataLoader(val_set, batch_size=args.speakers_per_batch, sampler=val_sampler,
                                num_workers=4, drop_last=True)

    model = SpeakerEncoder().to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    run_dir = Path(args.models_dir) / args.run_id
    ckpt_path = run_dir / "encoder.pt"
    start_epoch = 0
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model_state"])
        optimizer.load_state_dict(ckpt["optimizer_state"])
        start_epoch = ckpt["epoch"] + 1
    writer = None
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(str(run_dir / "tb"))

    step = start_epoch * len(loader)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in loader:
            s, u, t, c = batch.shape
            batch = batch.to(device, non_blocking=True).view(s * u, t, c)
            embeds = model(batch).view(s, u, -1)
            loss, eer = model.module.ge2e_loss(embeds)

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # GE2E tricks: smaller gradient on the similarity scale / bias, clip the LSTM
            model.module.similarity_weight.grad *= 0.01
            model.module.similarity_bias.grad *= 0.01
            nn.utils.clip_grad_norm_(model.parameters(), 3.0)
            optimizer.step()
            step += 1

            if rank == 0 and step % 50 == 0:
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/eer", eer, step)
                writer.add_scalar("train/sim_w", model.module.similarity_weight.item(), step)

        if val_loader is not None:
            model.eval()
            eer_sum, n = 0.0, 0
            with torch.no_grad():
                for batch in val_loader:
                    s, u, t, c = batch.shape
                    embeds = model.module(batch.to(device).view(s * u, t, c)).view(s, u, -1)
                    _, eer = model.module.ge2e_loss(embeds)
                    eer_sum += eer
                    n += 1
            stats = torch.tensor([eer_sum, float(n)], dtype=torch.float64)
            dist.all_reduce(stats)
            val_eer = (stats[0] / stats[1].clamp(min=1)).item()
            if rank == 0:
                writer.add_scalar("val/eer", val_eer, step)
                print(f"epoch {epoch}: val EER {val_eer * 100:.2f}% ({time.time() - t0:.0f}s)")

        if rank == 0 and (epoch + 1) % args.save_every == 0:
            torch.save({"epoch": epoch, "model_state": model.module.state_dict(),
                        "optimizer_state": optimizer.state_dict()}, ckpt_path)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
