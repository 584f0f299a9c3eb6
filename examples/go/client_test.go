// go test: runs the example against the service at ROLLOUT_TARGET
// (tests/integration/test_client_examples.py starts one, over TLS with a token).
package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	pb "rolloutclient/rolloutv1"
)

func TestRunStreamsValidatesAndAcksGroups(t *testing.T) {
	if os.Getenv("ROLLOUT_TARGET") == "" {
		t.Skip("set ROLLOUT_TARGET to a running service")
	}
	conn, err := ConnectionFromEnv(os.Getenv)
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	logf := func(format string, args ...any) { lines = append(lines, fmt.Sprintf(format, args...)) }
	ctx, cancel := context.WithTimeout(context.Background(), 240*time.Second)
	defer cancel()
	result, err := Run(ctx, conn, 3, 4, logf)
	if err != nil {
		t.Fatalf("%v\n%s", err, strings.Join(lines, "\n"))
	}
	distinct := map[string]bool{}
	for _, id := range result.Received {
		distinct[id] = true
	}
	if len(result.Received) != 3 || len(distinct) != 3 || result.GroupsTrained != 3 {
		t.Fatalf("received %v, service counts %d trained", result.Received, result.GroupsTrained)
	}
	if last := lines[len(lines)-1]; !strings.HasPrefix(last, "stats: 3 groups trained") {
		t.Fatalf("last line %q", last)
	}
}

func TestMalformedGroupIsRefused(t *testing.T) {
	sample := &pb.Sample{CompletionTokenIds: []uint32{2, 3}, CompletionLogprobs: []float32{-1}, CompletionMask: []uint32{1, 1}}
	group := &pb.Group{GroupId: "g", PromptTokenIds: []uint32{1}, Samples: []*pb.Sample{sample, sample}, DeliveryAttempt: 1}
	err := ValidateGroup(group, 2)
	if err == nil || !strings.Contains(err.Error(), "differ in length") {
		t.Fatalf("got %v", err)
	}
}

func TestConnectionReadsTheTokenFileAndRefusesABadCA(t *testing.T) {
	dir := t.TempDir()
	tokenFile := dir + "/token"
	if err := os.WriteFile(tokenFile, []byte("secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"ROLLOUT_TOKEN_FILE": tokenFile}
	conn, err := ConnectionFromEnv(func(name string) string { return env[name] })
	if err != nil || conn.Token != "secret" || conn.Target != "127.0.0.1:50051" || conn.Credentials != nil {
		t.Fatalf("got %+v, %v", conn, err)
	}
	env["ROLLOUT_TLS_CA"] = tokenFile
	if _, err := ConnectionFromEnv(func(name string) string { return env[name] }); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Fatalf("got %v", err)
	}
}
