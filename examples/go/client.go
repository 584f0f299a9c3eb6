// A Go client of the rollout service, written from proto/rollout/v1/rollout.proto: health
// check, a run, a credit-based stream with acks (each group validated), stats.
//
//	examples/go/generate.sh                     # the stubs, into examples/go/rolloutv1/
//	cd examples/go && go mod tidy && go run .   # ROLLOUT_TARGET (default 127.0.0.1:50051)
//	ROLLOUT_TLS_CA=ca.crt ROLLOUT_TOKEN=... go run .
//
// What the proto alone does not say, and this client does about it:
//   - the server sends up to 64 MiB per message; clients receive 4 MiB by default: raised here.
//   - one invalid ack ends the whole stream with its status: ack only ids this stream received.
//   - ACK_STATUS_UNSPECIFIED counts as TRAINED: say TRAINED or DROPPED_STALE explicitly.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"math"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	pb "rolloutclient/rolloutv1"
)

const maxMessageBytes = 64 * 1024 * 1024

// Connection is where and how to reach the service, read from the environment as the
// Python and Node clients read it.
type Connection struct {
	Target      string
	Credentials credentials.TransportCredentials // nil: plaintext
	Token       string
}

// ConnectionFromEnv reads ROLLOUT_TARGET, ROLLOUT_TLS_CA (with ROLLOUT_TLS_CERT and
// ROLLOUT_TLS_KEY for mutual TLS), and ROLLOUT_TOKEN or ROLLOUT_TOKEN_FILE.
func ConnectionFromEnv(getenv func(string) string) (Connection, error) {
	conn := Connection{Target: getenv("ROLLOUT_TARGET")}
	if conn.Target == "" {
		conn.Target = "127.0.0.1:50051"
	}
	if caFile := getenv("ROLLOUT_TLS_CA"); caFile != "" {
		ca, err := os.ReadFile(caFile)
		if err != nil {
			return conn, fmt.Errorf("ROLLOUT_TLS_CA: %w", err)
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(ca) {
			return conn, fmt.Errorf("ROLLOUT_TLS_CA: no PEM certificate in %s", caFile)
		}
		config := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}
		if certFile, keyFile := getenv("ROLLOUT_TLS_CERT"), getenv("ROLLOUT_TLS_KEY"); certFile != "" || keyFile != "" {
			pair, err := tls.LoadX509KeyPair(certFile, keyFile)
			if err != nil {
				return conn, fmt.Errorf("ROLLOUT_TLS_CERT and ROLLOUT_TLS_KEY must name a certificate and its key: %w", err)
			}
			config.Certificates = []tls.Certificate{pair}
		}
		conn.Credentials = credentials.NewTLS(config)
	}
	conn.Token = getenv("ROLLOUT_TOKEN")
	if tokenFile := getenv("ROLLOUT_TOKEN_FILE"); conn.Token == "" && tokenFile != "" {
		token, err := os.ReadFile(tokenFile)
		if err != nil {
			return conn, fmt.Errorf("ROLLOUT_TOKEN_FILE: %w", err)
		}
		conn.Token = strings.TrimSpace(string(token))
	}
	return conn, nil
}

// Dial opens the channel; every call made with Context carries the token.
func (c Connection) Dial() (*grpc.ClientConn, error) {
	transport := grpc.WithInsecure()
	if c.Credentials != nil {
		transport = grpc.WithTransportCredentials(c.Credentials)
	}
	return grpc.Dial(c.Target, transport, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessageBytes)))
}

// Context bounds a call by timeout and attaches the bearer token, if any.
func (c Connection) Context(parent context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(parent, timeout)
	if c.Token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.Token)
	}
	return ctx, cancel
}

// ValidateGroup fails unless the group is well formed: G samples, aligned
// ids/logprobs/mask, advantages centred.
func ValidateGroup(group *pb.Group, groupSize int) error {
	if len(group.Samples) != groupSize {
		return fmt.Errorf("group %s: %d samples, not %d", group.GroupId, len(group.Samples), groupSize)
	}
	mean := 0.0
	for _, sample := range group.Samples {
		n := len(sample.CompletionTokenIds)
		if n == 0 || len(sample.CompletionLogprobs) != n || len(sample.CompletionMask) != n {
			return fmt.Errorf("group %s: completion ids, logprobs and mask differ in length", group.GroupId)
		}
		mean += float64(sample.Advantage) / float64(groupSize)
	}
	if len(group.PromptTokenIds) == 0 {
		return fmt.Errorf("group %s: no prompt ids", group.GroupId)
	}
	if math.Abs(mean) > 1e-3 {
		return fmt.Errorf("group %s: advantages average %g, not 0", group.GroupId, mean)
	}
	// 1 the first time; more if an earlier holder left without acking (it may have trained it).
	if group.DeliveryAttempt < 1 {
		return fmt.Errorf("group %s: no delivery_attempt", group.GroupId)
	}
	return nil
}

// Result is what Run saw: the groups it received and acked, and the service's count of them.
type Result struct {
	RunID         string
	Received      []string
	GroupsTrained uint64
}

// Run checks health, creates a run, streams `groups` groups with credits and acks them,
// reads the stats and deletes the run.
func Run(ctx context.Context, conn Connection, groups, groupSize int, logf func(string, ...any)) (Result, error) {
	channel, err := conn.Dial()
	if err != nil {
		return Result{}, err
	}
	defer channel.Close()
	client := pb.NewRolloutServiceClient(channel)

	call, cancel := conn.Context(ctx, 10*time.Second)
	status, err := healthpb.NewHealthClient(channel).Check(call, &healthpb.HealthCheckRequest{})
	cancel()
	if err != nil {
		return Result{}, fmt.Errorf("health: %w", err)
	}
	if status.Status != healthpb.HealthCheckResponse_SERVING {
		return Result{}, fmt.Errorf("service health is %s", status.Status)
	}

	spec := &pb.RunSpec{
		PromptSource:      &pb.PromptSource{Source: &pb.PromptSource_Dataset{Dataset: "repeat_a"}},
		Sampling:          &pb.SamplingParams{MaxTokens: 8},
		GroupSize:         uint32(groupSize),
		RewardFunctions:   []*pb.RewardFunctionSpec{{Name: "char_fraction"}}, // weight unset: 1
		MaxBufferedGroups: uint32(groups),
	}
	call, cancel = conn.Context(ctx, 30*time.Second)
	created, err := client.CreateRun(call, &pb.CreateRunRequest{Spec: spec})
	cancel()
	if err != nil {
		return Result{}, fmt.Errorf("CreateRun: %w", err)
	}
	result := Result{RunID: created.Run.RunId}
	logf("run %s at policy version %d", result.RunID, created.Run.PolicyVersion)

	if result.Received, err = stream(ctx, conn, client, result.RunID, groups, groupSize, logf); err != nil {
		return result, err
	}

	call, cancel = conn.Context(ctx, 30*time.Second)
	defer cancel()
	stats, err := client.GetStats(call, &pb.GetStatsRequest{})
	if err != nil {
		return result, fmt.Errorf("GetStats: %w", err)
	}
	result.GroupsTrained = stats.Runs[result.RunID].GetGroupsTrained()
	logf("stats: %d groups trained, %d tokens generated", result.GroupsTrained, stats.TokensGenerated)
	if _, err := client.DeleteRun(call, &pb.DeleteRunRequest{RunId: result.RunID}); err != nil {
		return result, fmt.Errorf("DeleteRun: %w", err)
	}
	return result, nil
}

func stream(ctx context.Context, conn Connection, client pb.RolloutServiceClient, runID string, groups, groupSize int, logf func(string, ...any)) ([]string, error) {
	call, cancel := conn.Context(ctx, 240*time.Second)
	defer cancel()
	samples, err := client.StreamSamples(call)
	if err != nil {
		return nil, fmt.Errorf("StreamSamples: %w", err)
	}
	subscribe := &pb.Subscribe{RunId: runID, ConsumerId: "go-example", InitialCredits: uint32(groups)}
	if err := samples.Send(&pb.StreamSamplesRequest{Kind: &pb.StreamSamplesRequest_Subscribe{Subscribe: subscribe}}); err != nil {
		return nil, fmt.Errorf("subscribe: %w", err)
	}
	var received []string
	for len(received) < groups {
		message, err := samples.Recv()
		if errors.Is(err, io.EOF) {
			return received, fmt.Errorf("the stream ended after %d of %d groups", len(received), groups)
		}
		if err != nil {
			return received, fmt.Errorf("StreamSamples: %w", err)
		}
		group := message.GetGroup()
		if group == nil {
			continue // subscribed, or weights_wanted (for a pushing trainer), or a stall notice
		}
		if err := ValidateGroup(group, groupSize); err != nil {
			return received, err
		}
		received = append(received, group.GroupId)
		rewards := make([]string, len(group.Samples))
		for i, sample := range group.Samples {
			rewards[i] = fmt.Sprintf("%.2f", sample.Reward)
		}
		logf("group %s (delivery %d): rewards %s", group.GroupId, group.DeliveryAttempt, strings.Join(rewards, " "))
		// An ack frees the group; no new credit is granted once enough are on their way.
		ack := &pb.Ack{GroupIds: []string{group.GroupId}, Status: pb.AckStatus_ACK_STATUS_TRAINED}
		if err := samples.Send(&pb.StreamSamplesRequest{Kind: &pb.StreamSamplesRequest_Ack{Ack: ack}}); err != nil {
			return received, fmt.Errorf("ack: %w", err)
		}
	}
	// Half-close, then read to the end so that the server has seen every ack.
	if err := samples.CloseSend(); err != nil {
		return received, err
	}
	for {
		if _, err := samples.Recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return received, nil
			}
			return received, fmt.Errorf("StreamSamples: %w", err)
		}
	}
}

func main() {
	conn, err := ConnectionFromEnv(os.Getenv)
	if err != nil {
		log.Fatalf("error: %v", err)
	}
	logf := func(format string, args ...any) { fmt.Printf(format+"\n", args...) }
	if _, err := Run(context.Background(), conn, 4, 4, logf); err != nil {
		log.Fatalf("error: %v", err)
	}
}
