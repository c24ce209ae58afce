import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from dataset import Dataset
from model import FastSpeech2, FastSpeech2Loss, ScheduledOptim
from utils.model import get_vocoder, get_param_num
from utils.tools import to_device, log, synth_one_sample


def evaluate(model, step, configs, device, logger=None, vocoder=None):
    preprocess_config, model_config, train_config = configs

    dataset = Dataset("val.txt", preprocess_config, train_config, sort=False, drop_last=False)
    batch_size = train_config["optimizer"]["batch_size"]
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=dataset.collate_fn)

    Loss = FastSpeech2Loss(preprocess_config, model_config).to(device)

    loss_sums = [0 for _ in range(6)]
    for batchs in loader:
        for batch in batchs:
            batch = to_device(batch, device)
            with torch.no_grad():
                output = model(*(batch[2:]))
                losses = Loss(batch, output)
                for i in range(len(losses)):
                    loss_sums[i] += losses[i].item() * len(batch[0])

    loss_means = [loss_sum / len(dataset) for loss_sum in loss_sums]
    message = "Validation Step {}, Total Loss: {:.4f}, Mel Loss: {:.4f}, Mel PostNet Loss: {:.4f}, " \
              "Pitch Loss: {:.4f}, Energy Loss: {:.4f}, Duration Loss: {:.4f}".format(*([step] + loss_means))

    if logger is not None:
        fig, wav_reconstruction, wav_prediction, tag = synth_one_sample(
            batch, output, vocoder, model_config, preprocess_config)
        log(logger, step, losses=loss_means)
        log(logger, fig=fig, tag="Validation/step_{}_{}".format(step, tag))
        sampling_rate = preprocess_config["preprocessing"]["audio"]["sampling_rate"]
        log(logger, audio=wav_reconstruction, sampling_rate=sampling_rate,
            tag="Validation/step_{}_{}_reconstructed".format(step, tag))
        log(logger, audio=wav_prediction, sampling_rate=sampling_rate,
            tag="Validation/step_{}_{}_synthesized".format(step, tag))
    return message


def main(args, configs):
    preprocess_config, model_config, train_config = configs

    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank)
    is_main = rank == 0
    if is_main:
        print("Prepare training ...")

    # Get dataset
    dataset = Dataset("train.txt", preprocess_config, train_config, sort=True, drop_last=True)
    batch_size = train_config["optimizer"]["batch_size"]
    group_size = 4  # Set this larger than 1 to enable sorting in Dataset
    assert batch_size * group_size < len(dataset)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    loader = DataLoader(dataset, batch_size=batch_size * group_size, sampler=sampler,
                        collate_fn=dataset.collate_fn, num_workers=4, pin_memory=True, drop_last=True)

    # Prepare model
    model = FastSpeech2(preprocess_config, model_config).to(device)
    optimizer = ScheduledOptim(model, train_config, model_config, args.restore_step)
    if args.restore_step:
        ckpt_path = os.path.join(train_config["path"]["ckpt_path"], "{}.pth.tar".format(args.restore_step))
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    model = DDP(model, device_ids=[args.local_rank], output_device=args.local_rank)
    model.train()
    num_param = get_param_num(model)
    Loss = FastSpeech2Loss(preprocess_config, model_config).to(device)
    if is_main:
        print("Number of FastSpeech2 Parameters:", num_param)

    # Load vocoder (rank 0 only, used for validation audio)
    vocoder = get_vocoder(model_config, device) if is_main else None

    # Init logger
    if is_main:
        for p in train_config["path"].values():
            os.makedirs(p, exist_ok=True)
        train_log_path = os.path.join(train_config["path"]["log_path"], "train")
        val_log_path = os.path.join(train_config["path"]["log_path"], "val")
        os.makedirs(train_log_path, exist_ok=True)
        os.makedirs(val_log_path, exist_ok=True)
        train_logger = SummaryWriter(train_log_path)
        val_logger = SummaryWriter(val_log_path)

    # Training
    step = args.restore_step + 1
    epoch = 1
    grad_acc_step = train_config["optimizer"]["grad_acc_step"]
    grad_clip_thresh = train_config["optimizer"]["grad_clip_thresh"]
    total_step = train_config["step"]["total_step"]
    log_step = train_config["step"]["log_step"]
    save_step = train_config["step"]["save_step"]
    synth_step = train_config["step"]["synth_step"]
    val_step = train_config["step"]["val_step"]

    outer_bar = tqdm(total=total_step, desc="Training", position=0, disable=not is_main)
    outer_bar.n = args.restore_step
    outer_bar.update()

    while True:
        sampler.set_epoch(epoch)
        for batchs in loader:
            for batch in batchs:
                batch = to_device(batch, device)

                # Forward
                output = model(*(batch[2:]))

                # Cal Loss
                losses = Loss(batch, output)
                total_loss = losses[0]

                # Backward
                total_loss = total_loss / grad_acc_step
                if step % grad_acc_step != 0:
                    with model.no_sync():
                        total_loss.backward()
                else:
                    total_loss.backward()
                    # Clipping gradients to avoid gradient explosion
                    nn.utils.clip_grad_norm_(model.parameters(), grad_clip_thresh)

                    # Update weights
                    optimizer.step_and_update_lr()
                    optimizer.zero_grad()

                if is_main:
                    if step % log_step == 0:
                        losses = [l.item() for l in losses]
                        message1 = "Step {}/{}, ".format(step, total_step)
                        message2 = "Total Loss: {:.4f}, Mel Loss: {:.4f}, Mel PostNet Loss: {:.4f}, " \
                                   "Pitch Loss: {:.4f}, Energy Loss: {:.4f}, Duration Loss: {:.4f}".format(*losses)
                        with open(os.path.join(train_log_path, "log.txt"), "a") as f:
                            f.write(message1 + message2 + "\n")
                        outer_bar.write(message1 + message2)
                        log(train_logger, step, losses=losses)

                    if step % synth_step == 0:
                        fig, wav_reconstruction, wav_prediction, tag = synth_one_sample(
                            batch, output, vocoder, model_config, preprocess_config)
                        log(train_logger, fig=fig, tag="Training/step_{}_{}".format(step, tag))

                    if step % val_step == 0:
                        model.eval()
                        message = evaluate(model.module, step, configs, device, val_logger, vocoder)
                        with open(os.path.join(val_log_path, "log.txt"), "a") as f:
                            f.write(message + "\n")
                        outer_bar.write(message)
                        model.train()

                    if step % save_step == 0:
                        torch.save({"model": model.module.state_dict(),
                                    "optimizer": optimizer._optimizer.state_dict()},
                                   os.path.join(train_config["path"]["ckpt_path"], "{}.pth.tar".format(step)))

                if step == total_step:
                    dist.barrier()
                    dist.destroy_process_group()
                    return
                step += 1
                outer_bar.update(1)
        epoch += 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--restore_step", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("-p", "--preprocess_config", type=str, required=True, help="path to preprocess.yaml")
    parser.add_argument("-m", "--model_config", type=str, required=True, help="path to model.yaml")
    parser.add_argument("-t", "--train_config", type=str, required=True, help="path to train.yaml")
    args = parser.parse_args()

    preprocess_config = yaml.load(open(args.preprocess_config, "r"), Loader=yaml.FullLoader)
    model_config = yaml.load(open(args.model_config, "r"), Loader=yaml.FullLoader)
    train_config = yaml.load(open(args.train_config, "r"), Loader=yaml.FullLoader)
    configs = (preprocess_config, model_config, train_config)

    main(args, configs)
