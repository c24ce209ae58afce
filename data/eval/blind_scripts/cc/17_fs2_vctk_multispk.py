"""Multi-speaker FastSpeech2 on VCTK (preprocessed with preprocess.py: mel/pitch/energy/duration .npy).

torchrun --nproc_per_node=4 17_fs2_vctk_multispk.py -p config/VCTK/preprocess.yaml \
    -m config/VCTK/model.yaml -t config/VCTK/train.yaml
"""
import argparse
import contextlib
import json
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from model import FastSpeech2, FastSpeech2Loss, ScheduledOptim
from text import text_to_sequence
from utils.tools import pad_1D, pad_2D, plot_mel, synth_one_sample, get_vocoder


def read_metadata(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            name, speaker, text, raw_text = line.strip("\n").split("|")
            rows.append((name, speaker, text, raw_text))
    return rows


class VCTKDataset(Dataset):
    def __init__(self, rows, preprocess_config, speaker_map):
        self.rows = rows
        self.path = preprocess_config["path"]["preprocessed_path"]
        self.cleaners = preprocess_config["preprocessing"]["text"]["text_cleaners"]
        self.speaker_map = speaker_map

    def __len__(self):
        return len(self.rows)

    def _load(self, kind, speaker, name):
        return np.load(os.path.join(self.path, kind, f"{speaker}-{kind}-{name}.npy"))

    def __getitem__(self, idx):
        name, speaker, text, raw_text = self.rows[idx]
        return {
            "id": name,
            "speaker": self.speaker_map[speaker],
            "text": np.array(text_to_sequence(text, self.cleaners)),
            "raw_text": raw_text,
            "mel": self._load("mel", speaker, name),
            "pitch": self._load("pitch", speaker, name),
            "energy": self._load("energy", speaker, name),
            "duration": self._load("duration", speaker, name),
        }


def collate_fn(data):
    data = sorted(data, key=lambda d: d["text"].shape[0], reverse=True)
    ids = [d["id"] for d in data]
    raw_texts = [d["raw_text"] for d in data]
    speakers = torch.LongTensor([d["speaker"] for d in data])
    texts = [d["text"] for d in data]
    mels = [d["mel"] for d in data]
    text_lens = torch.LongTensor([t.shape[0] for t in texts])
    mel_lens = torch.LongTensor([m.shape[0] for m in mels])
    return (ids, raw_texts, speakers, torch.from_numpy(pad_1D(texts)).long(), text_lens, int(text_lens.max()),
            torch.from_numpy(pad_2D(mels)).float(), mel_lens, int(mel_lens.max()),
            torch.from_numpy(pad_1D([d["pitch"] for d in data])).float(),
            torch.from_numpy(pad_1D([d["energy"] for d in data])).float(),
            torch.from_numpy(pad_1D([d["duration"] for d in data])).long())


def to_device(batch, device):
    ids, raw_texts, *tensors = batch
    return (ids, raw_texts) + tuple(t.to(device, non_blocking=True) if torch.is_tensor(t) else t for t in tensors)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--restore_step", type=int, default=0)
    parser.add_argument("-p", "--preprocess_config", required=True)
    parser.add_argument("-m", "--model_config", required=True)
    parser.add_argument("-t", "--train_config", required=True)
    args = parser.parse_args()
    preprocess_config = yaml.load(open(args.preprocess_config), Loader=yaml.FullLoader)
    model_config = yaml.load(open(args.model_config), Loader=yaml.FullLoader)
    train_config = yaml.load(open(args.train_config), Loader=yaml.FullLoader)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    pp = preprocess_config["path"]["preprocessed_path"]
    train_rows = read_metadata(os.path.join(pp, "train.txt"))
    val_rows = read_metadata(os.path.join(pp, "val.txt"))
    speakers = {r[1] for r in train_rows + val_rows}
    speaker_map = {spk: i for i, spk in enumerate(speakers)}
    model_config["n_speaker"] = len(speaker_map)

    paths = train_config["path"]
    if rank == 0:
        for p in (paths["ckpt_path"], paths["log_path"], paths["result_path"]):
            os.makedirs(p, exist_ok=True)
        with open(os.path.join(paths["ckpt_path"], "speakers.json"), "w") as f:
            json.dump(speaker_map, f, indent=2)

    batch_size = train_config["optimizer"]["batch_size"]
    train_ds = VCTKDataset(train_rows, preprocess_config, speaker_map)
    val_ds = VCTKDataset(val_rows, preprocess_config, speaker_map)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                        num_workers=4, pin_memory=True, drop_last=True)

    model = FastSpeech2(preprocess_config, model_config).to(device)
    optimizer = ScheduledOptim(model, train_config, model_config, args.restore_step)
    if args.restore_step:
        ckpt = torch.load(os.path.join(paths["ckpt_path"], f"{args.restore_step}.pth.tar"), map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    model = DDP(model, device_ids=[local_rank])
    loss_fn = FastSpeech2Loss(preprocess_config, model_config).to(device)

    writer = SummaryWriter(os.path.join(paths["log_path"], "train")) if rank == 0 else None
    val_writer = SummaryWriter(os.path.join(paths["log_path"], "val")) if rank == 0 else None
    vocoder = get_vocoder(model_config, device) if rank == 0 else None

    step = args.restore_step + 1
    epoch = 1
    grad_acc = train_config["optimizer"]["grad_acc_step"]
    grad_clip = train_config["optimizer"]["grad_clip_thresh"]
    total_step = train_config["step"]["total_step"]
    log_step, synth_step = train_config["step"]["log_step"], train_config["step"]["synth_step"]
    val_step, save_step = train_config["step"]["val_step"], train_config["step"]["save_step"]

    pbar = tqdm(total=total_step, initial=args.restore_step, disable=rank != 0)
    done = False
    while not done:
        sampler.set_epoch(epoch)
        model.train()
        for i, batch in enumerate(loader):
            batch = to_device(batch, device)
            sync = (i + 1) % grad_acc == 0
            ctx = model.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                output = model(*batch[2:])
                losses = loss_fn(batch, output)
                (losses[0] / grad_acc).backward()
            if not sync:
                continue
            nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optimizer.step_and_update_lr()
            optimizer.zero_grad()

            if step % log_step == 0:
                red = torch.stack([l.detach() for l in losses])
                dist.all_reduce(red)
                red = (red / world).tolist()
                if rank == 0:
                    msg = ("Total Loss: {:.4f}, Mel Loss: {:.4f}, Mel PostNet Loss: {:.4f}, Pitch Loss: {:.4f}, "
                           "Energy Loss: {:.4f}, Duration Loss: {:.4f}").format(*red)
                    pbar.write(f"Step {step}/{total_step}, " + msg)
                    for k, v in zip(["total", "mel", "mel_postnet", "pitch", "energy", "duration"], red):
                        writer.add_scalar(f"Loss/{k}", v, step)

            if rank == 0 and step % synth_step == 0:
                fig, wav_rec, wav_pred, tag = synth_one_sample(batch, output, vocoder, model_config, preprocess_config)
                writer.add_figure(f"Training/step_{step}_{tag}", fig, step)
                sr = preprocess_config["preprocessing"]["audio"]["sampling_rate"]
                writer.add_audio(f"Training/step_{step}_{tag}_reconstructed", wav_rec / max(abs(wav_rec)), step, sr)
                writer.add_audio(f"Training/step_{step}_{tag}_synthesized", wav_pred / max(abs(wav_pred)), step, sr)

            if step % val_step == 0:
                model.eval()
                shard = torch.utils.data.Subset(val_ds, range(rank, len(val_ds), world))
                vl = DataLoader(shard, batch_size=batch_size, collate_fn=collate_fn, num_workers=2)
                acc = torch.zeros(7, device=device)
                with torch.no_grad():
                    for vb in vl:
                        vb = to_device(vb, device)
                        vout = model.module(*vb[2:])
                        vlosses = loss_fn(vb, vout)
                        n = len(vb[0])
                        acc[:6] += torch.stack([l.detach() for l in vlosses]) * n
                        acc[6] += n
                dist.all_reduce(acc)
                if rank == 0:
                    for k, v in zip(["total", "mel", "mel_postnet", "pitch", "energy", "duration"],
                                    (acc[:6] / acc[6]).tolist()):
                        val_writer.add_scalar(f"Loss/{k}", v, step)
                model.train()

            if rank == 0 and step % save_step == 0:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer._optimizer.state_dict()},
                           os.path.join(paths["ckpt_path"], f"{step}.pth.tar"))

            if step >= total_step:
                done = True
                break
            step += 1
            pbar.update(1)
        epoch += 1

    pbar.close()
    if rank == 0:
        writer.close(); val_writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
