#-------------------------------------
# Relation Network (Sung et al., CVPR 2018) - Omniglot 5-way 1-shot
# DDP version of our single-GPU training script.
#
#   torchrun --nproc_per_node=4 12_relationnet_omniglot.py -w 5 -s 1 -b 19
#-------------------------------------
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR

import task_generator_omniglot as tg

parser = argparse.ArgumentParser(description="One Shot Visual Recognition")
parser.add_argument("-f", "--feature_dim", type=int, default=64)
parser.add_argument("-r", "--relation_dim", type=int, default=8)
parser.add_argument("-w", "--class_num", type=int, default=5)
parser.add_argument("-s", "--sample_num_per_class", type=int, default=1)
parser.add_argument("-b", "--batch_num_per_class", type=int, default=19)
parser.add_argument("-e", "--episode", type=int, default=1000000)
parser.add_argument("-t", "--test_episode", type=int, default=1000)
parser.add_argument("-l", "--learning_rate", type=float, default=0.001)
parser.add_argument("--ckpt_dir", default="./models")
parser.add_argument("--seed", type=int, default=17)
args = parser.parse_args()

FEATURE_DIM = args.feature_dim
RELATION_DIM = args.relation_dim
CLASS_NUM = args.class_num
SAMPLE_NUM_PER_CLASS = args.sample_num_per_class
BATCH_NUM_PER_CLASS = args.batch_num_per_class
EPISODE = args.episode
TEST_EPISODE = args.test_episode
LEARNING_RATE = args.learning_rate
GPU = 0


class CNNEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 64, 3, padding=0), nn.BatchNorm2d(64, momentum=1, affine=True),
                                    nn.ReLU(), nn.MaxPool2d(2))
        self.layer2 = nn.Sequential(nn.Conv2d(64, 64, 3, padding=0), nn.BatchNorm2d(64, momentum=1, affine=True),
                                    nn.ReLU(), nn.MaxPool2d(2))
        self.layer3 = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64, momentum=1, affine=True),
                                    nn.ReLU())
        self.layer4 = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64, momentum=1, affine=True),
                                    nn.ReLU())

    def forward(self, x):
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


class RelationNetwork(nn.Module):
    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(128, 64, 3, padding=1), nn.BatchNorm2d(64, momentum=1, affine=True),
                                    nn.ReLU(), nn.MaxPool2d(2))
        self.layer2 = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64, momentum=1, affine=True),
                                    nn.ReLU(), nn.MaxPool2d(2))
        self.fc1 = nn.Linear(input_size, hidden_size)
        self.fc2 = nn.Linear(hidden_size, 1)

    def forward(self, x):
        out = self.layer2(self.layer1(x))
        out = out.view(out.size(0), -1)
        out = F.relu(self.fc1(out))
        return torch.sigmoid(self.fc2(out))


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        n = m.kernel_size[0] * m.kernel_size[1] * m.out_channels
        m.weight.data.normal_(0, math.sqrt(2. / n))
        if m.bias is not None:
            m.bias.data.zero_()
    elif classname.find("BatchNorm") != -1:
        m.weight.data.fill_(1)
        m.bias.data.zero_()
    elif classname.find("Linear") != -1:
        m.weight.data.normal_(0, 0.01)
        m.bias.data = torch.ones(m.bias.data.size())


def relations_for(feature_encoder, relation_network, samples, batches, n_query_total):
    # one encoder pass for support and query images
    features = feature_encoder(torch.cat([samples, batches]))  # [N, 64, 5, 5]
    n_support = samples.size(0)
    sample_features = features[:n_support].view(CLASS_NUM, SAMPLE_NUM_PER_CLASS, FEATURE_DIM, 5, 5).sum(1)
    batch_features = features[n_support:]
    sample_ext = sample_features.unsqueeze(0).repeat(n_query_total, 1, 1, 1, 1)
    batch_ext = batch_features.unsqueeze(0).repeat(CLASS_NUM, 1, 1, 1, 1).transpose(0, 1)
    pairs = torch.cat((sample_ext, batch_ext), 2).view(-1, FEATURE_DIM * 2, 5, 5)
    return relation_network(pairs).view(-1, CLASS_NUM)


def main():
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    # character folders are split with random.seed(1) inside the task generator (1200 / 423),
    # so do this before seeding the per-rank task stream
    metatrain_character_folders, metatest_character_folders = tg.omniglot_character_folders()
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    feature_encoder = CNNEncoder()
    relation_network = RelationNetwork(FEATURE_DIM, RELATION_DIM)
    feature_encoder.apply(weights_init)
    relation_network.apply(weights_init)
    feature_encoder = DDP(feature_encoder.to(device), device_ids=[local_rank])
    relation_network = DDP(relation_network.to(device), device_ids=[local_rank])

    feature_encoder_optim = torch.optim.Adam(feature_encoder.parameters(), lr=LEARNING_RATE)
    feature_encoder_scheduler = StepLR(feature_encoder_optim, step_size=100000, gamma=0.5)
    relation_network_optim = torch.optim.Adam(relation_network.parameters(), lr=LEARNING_RATE)
    relation_network_scheduler = StepLR(relation_network_optim, step_size=100000, gamma=0.5)
    mse = nn.MSELoss().to(device)

    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print("Training...")
    last_accuracy = 0.0
    for episode in range(EPISODE):
        degrees = random.choice([0, 90, 180, 270])
        task = tg.OmniglotTask(metatrain_character_folders, CLASS_NUM, SAMPLE_NUM_PER_CLASS, BATCH_NUM_PER_CLASS)
        sample_dataloader = tg.get_data_loader(task, num_per_class=SAMPLE_NUM_PER_CLASS, split="train",
                                               shuffle=False, rotation=degrees)
        batch_dataloader = tg.get_data_loader(task, num_per_class=BATCH_NUM_PER_CLASS, split="test",
                                              shuffle=True, rotation=degrees)
        samples, sample_labels = next(iter(sample_dataloader))
        batches, batch_labels = next(iter(batch_dataloader))

        relations = relations_for(feature_encoder, relation_network, samples.to(device),
                                  batches.to(device), BATCH_NUM_PER_CLASS * CLASS_NUM)
        one_hot_labels = torch.zeros(BATCH_NUM_PER_CLASS * CLASS_NUM, CLASS_NUM).scatter_(
            1, batch_labels.view(-1, 1), 1).cuda(GPU)
        loss = mse(relations, one_hot_labels)

        feature_encoder.zero_grad()
        relation_network.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(feature_encoder.parameters(), 0.5)
        torch.nn.utils.clip_grad_norm_(relation_network.parameters(), 0.5)
        feature_encoder_optim.step()
        relation_network_optim.step()
        feature_encoder_scheduler.step()
        relation_network_scheduler.step()

        if rank == 0 and (episode + 1) % 100 == 0:
            print(f"episode: {episode + 1} loss {loss.item():.5f}", flush=True)

        if (episode + 1) % 5000 == 0:
            feature_encoder.eval()
            relation_network.eval()
            total_rewards = torch.zeros(2, device=device)
            with torch.no_grad():
                for _ in range(TEST_EPISODE // world_size):
                    degrees = random.choice([0, 90, 180, 270])
                    task = tg.OmniglotTask(metatest_character_folders, CLASS_NUM, SAMPLE_NUM_PER_CLASS,
                                           SAMPLE_NUM_PER_CLASS)
                    s_loader = tg.get_data_loader(task, num_per_class=SAMPLE_NUM_PER_CLASS, split="train",
                                                  shuffle=False, rotation=degrees)
                    t_loader = tg.get_data_loader(task, num_per_class=SAMPLE_NUM_PER_CLASS, split="test",
                                                  shuffle=True, rotation=degrees)
                    s_images, _ = next(iter(s_loader))
                    t_images, t_labels = next(iter(t_loader))
                    rel = relations_for(feature_encoder, relation_network, s_images.to(device),
                                        t_images.to(device), t_images.size(0))
                    pred = rel.argmax(1).cpu()
                    total_rewards += torch.tensor([(pred == t_labels).sum().item(), t_labels.numel()],
                                                  device=device, dtype=torch.float)
            dist.all_reduce(total_rewards)
            test_accuracy = (total_rewards[0] / total_rewards[1]).item()
            feature_encoder.train()
            relation_network.train()
            if rank == 0:
                print(f"test accuracy: {test_accuracy:.4f}", flush=True)
                if test_accuracy > last_accuracy:
                    tag = f"omniglot_{CLASS_NUM}way_{SAMPLE_NUM_PER_CLASS}shot.pkl"
                    torch.save(feature_encoder.module.state_dict(),
                               os.path.join(args.ckpt_dir, "feature_encoder_" + tag))
                    torch.save(relation_network.module.state_dict(),
                               os.path.join(args.ckpt_dir, "relation_network_" + tag))
                    print("save networks for episode:", episode + 1)
            last_accuracy = max(last_accuracy, test_accuracy)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
