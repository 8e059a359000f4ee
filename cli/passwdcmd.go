package cli

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/tandem-edge/tandem/config"
	"github.com/tandem-edge/tandem/mqtt"
	"golang.org/x/crypto/bcrypt"
	"golang.org/x/term"
)

// newPasswdCmd is `tandem passwd USER`: it prints the users-file line for
// USER with the password read from the terminal (asked twice) or, when
// stdin is not a terminal, from the first line of stdin.
func newPasswdCmd() *cobra.Command {
	var cost int
	cmd := &cobra.Command{
		Use:   "passwd USER",
		Short: "Print a users-file line (user:bcrypt-hash) for USER",
		Long: "Print the line for mqtt.users_file that gives USER a password: user:bcrypt-hash. " +
			"The password is asked twice on a terminal, or read from the first line of stdin, so it never appears in the process list or shell history. " +
			"Append the line to the users file and send the daemon SIGHUP (systemctl reload tandem).",
		Example: "  tandem passwd sensor-12 >> /etc/tandem/users\n  printf '%s\\n' \"$PW\" | tandem passwd sensor-12",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := mqtt.CheckUserName(args[0]); err != nil {
				return config.UsageError{Err: err}
			}
			pw, err := readPassword(cmd.InOrStdin(), cmd.ErrOrStderr())
			if err != nil {
				return config.UsageError{Err: err}
			}
			line, err := mqtt.HashPassword(args[0], pw, cost)
			if err != nil {
				return config.UsageError{Err: err}
			}
			fmt.Fprintln(cmd.OutOrStdout(), line)
			return nil
		},
	}
	cmd.Flags().IntVar(&cost, "cost", bcrypt.DefaultCost, "bcrypt cost (4-31): each step doubles the time a login takes, on the gateway too")
	return cmd
}

// readPassword reads a password: from a terminal without echo, twice; from
// anything else, the first line.
func readPassword(in io.Reader, prompt io.Writer) ([]byte, error) {
	if f, ok := in.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		fmt.Fprint(prompt, "Password: ")
		pw, err := term.ReadPassword(int(f.Fd()))
		fmt.Fprintln(prompt)
		if err != nil {
			return nil, err
		}
		fmt.Fprint(prompt, "Again: ")
		again, err := term.ReadPassword(int(f.Fd()))
		fmt.Fprintln(prompt)
		if err != nil {
			return nil, err
		}
		if string(pw) != string(again) {
			return nil, errors.New("the passwords differ")
		}
		return pw, nil
	}
	line, err := bufio.NewReader(in).ReadString('\n')
	if err != nil && !(errors.Is(err, io.EOF) && line != "") {
		return nil, errors.New("no password on stdin")
	}
	return []byte(strings.TrimRight(line, "\r\n")), nil
}
