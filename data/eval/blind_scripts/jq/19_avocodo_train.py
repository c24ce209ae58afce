"""Avocodo vocoder (CoMBD + SBD discriminators, PQMF sub-bands) with Weights & Biases tracking.

    torchrun --nproc_per_node=8 19_avocodo_train.py --config configs/avocodo_v1.yaml --run_name avocodo_ljs_v1
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from avocodo.data import MelDataset, get_dataset_filelist, mel_spectrogram
from avocodo.losses import discriminator_loss, feature_loss, generator_loss
from avocodo.models import CoMBD, SBD, Generator
from avocodo.pqmf import PQMF


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--run_name", required=True)
    p.add_argument("--ckpt_dir", default="checkpoints")
    p.add_argument("--resume", default=None)
    return p.parse_args()


def mel(h, y):
    return mel_spectrogram(y.squeeze(1), h.audio.n_fft, h.audio.num_mels, h.audio.sampling_rate,
                           h.audio.hop_size, h.audio.win_size, h.audio.fmin, h.audio.fmax_for_loss)


def main():
    args = parse()
    h = OmegaConf.load(args.config)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(h.train.seed)

    run = wandb.init(project="avocodo", name=args.run_name, config=OmegaConf.to_container(h, resolve=True),
                     dir=args.ckpt_dir, resume="allow")

    train_files, val_files = get_dataset_filelist(h.data)
    trainset = MelDataset(train_files, h, split=True)
    sampler = DistributedSampler(trainset, shuffle=True, drop_last=True)
    loader = DataLoader(trainset, batch_size=h.train.batch_size, sampler=sampler, num_workers=h.train.num_workers,
                        pin_memory=True, drop_last=True)
    val_loader = None
    if rank == 0:
        valset = MelDataset(val_files, h, split=False)
        val_loader = DataLoader(valset, batch_size=1, shuffle=False, num_workers=1)

    gen = Generator(h.model.generator).to(device)
    combd = CoMBD(h.model.combd, PQMF(*h.model.pqmf_config.lv1)).to(device)
    sbd = SBD(h.model.sbd).to(device)
    opt_g = torch.optim.AdamW(gen.parameters(), h.train.lr, betas=(h.train.b1, h.train.b2))
    opt_d = torch.optim.AdamW(list(combd.parameters()) + list(sbd.parameters()), h.train.lr,
                              betas=(h.train.b1, h.train.b2))

    step, epoch0 = 0, 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        gen.load_state_dict(ck["gen"])
        combd.load_state_dict(ck["combd"])
        sbd.load_state_dict(ck["sbd"])
        opt_g.load_state_dict(ck["opt_g"])
        opt_d.load_state_dict(ck["opt_d"])
        step, epoch0 = ck["step"], ck["epoch"] + 1

    gen = DDP(gen, device_ids=[local_rank])
    combd = DDP(combd, device_ids=[local_rank])
    sbd = DDP(sbd, device_ids=[local_rank])
    sch_g = torch.optim.lr_scheduler.ExponentialLR(opt_g, h.train.lr_decay, last_epoch=epoch0 - 1)
    sch_d = torch.optim.lr_scheduler.ExponentialLR(opt_d, h.train.lr_decay, last_epoch=epoch0 - 1)
    pqmf_lv2 = PQMF(*h.model.pqmf_config.lv2).to(device)
    pqmf_lv1 = PQMF(*h.model.pqmf_config.lv1).to(device)

    if rank == 0:
        os.makedirs(os.path.join(args.ckpt_dir, args.run_name), exist_ok=True)

    for epoch in range(epoch0, h.train.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for x, y, _, y_mel in loader:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True).unsqueeze(1)
            y_mel = y_mel.to(device, non_blocking=True)

            ys = [pqmf_lv2.analysis(y)[:, : h.model.projection_filters[1]],
                  pqmf_lv1.analysis(y)[:, : h.model.projection_filters[2]], y]
            y_g_hats = gen(x)  # multi-scale outputs, last one is full band

            opt_d.zero_grad(set_to_none=True)
            d_r, d_g, _, _ = combd(ys, [t.detach() for t in y_g_hats])
            loss_combd, _, _ = discriminator_loss(d_r, d_g)
            d_r, d_g, _, _ = sbd(y, y_g_hats[-1].detach())
            loss_sbd, _, _ = discriminator_loss(d_r, d_g)
            loss_d = loss_combd + loss_sbd
            loss_d.backward()
            opt_d.step()

            opt_g.zero_grad(set_to_none=True)
            loss_mel = F.l1_loss(y_mel, mel(h, y_g_hats[-1])) * h.train.lambda_mel
            _, d_g, fm_r, fm_g = combd(ys, y_g_hats)
            loss_adv_combd, _ = generator_loss(d_g)
            loss_fm_combd = feature_loss(fm_r, fm_g)
            _, d_g, fm_r, fm_g = sbd(y, y_g_hats[-1])
            loss_adv_sbd, _ = generator_loss(d_g)
            loss_fm_sbd = feature_loss(fm_r, fm_g)
            loss_g = loss_adv_combd + loss_adv_sbd + loss_fm_combd + loss_fm_sbd + loss_mel
            loss_g.backward()
            opt_g.step()
            step += 1

            if rank == 0 and step % h.log.summary_interval == 0:
                wandb.log({"train/loss_g": loss_g.item(), "train/loss_d": loss_d.item(),
                           "train/mel_l1": loss_mel.item() / h.train.lambda_mel,
                           "train/fm": (loss_fm_combd + loss_fm_sbd).item(),
                           "train/lr": opt_g.param_groups[0]["lr"]}, step=step)

            if rank == 0 and step % h.log.validation_interval == 0:
                g = gen.module
                g.eval()
                err, audios = 0.0, []
                with torch.no_grad():
                    for j, (xv, yv, _, yv_mel) in enumerate(val_loader):
                        yv_hat = g(xv.to(device))[-1]
                        ym, yhm = yv_mel.to(device), mel(h, yv_hat)
                        n = min(ym.size(-1), yhm.size(-1))
                        err += F.l1_loss(ym[..., :n], yhm[..., :n]).item()
                        if j < 4:
                            audios.append(wandb.Audio(yv_hat.squeeze().cpu().numpy(),
                                                      sample_rate=h.audio.sampling_rate, caption=f"val_{j}"))
                g.train()
                wandb.log({"val/mel_l1": err / (j + 1), "val/audio": audios}, step=step)

            if rank == 0 and step % h.log.checkpoint_interval == 0:
                torch.save({"gen": gen.module.state_dict(), "combd": combd.module.state_dict(),
                            "sbd": sbd.module.state_dict(), "opt_g": opt_g.state_dict(),
                            "opt_d": opt_d.state_dict(), "step": step, "epoch": epoch},
                           os.path.join(args.ckpt_dir, args.run_name, f"ckpt_{step:08d}.pt"))

        sch_g.step()
        sch_d.step()
        if rank == 0:
            print(f"epoch {epoch} done in {time.time() - t0:.0f}s (step {step})", flush=True)

    run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
